"""PayGuard: does drafting pay, as realized? Adaptive k's cost model (adaptive.py) predicts
what a step with drafts earns; this measures whole steps and refuses drafting where it has not
paid."""

from __future__ import annotations

from moeserve.spec.adaptive import MAX_PROBE_SCALE


class _Rate:
    """Decayed sums of tokens emitted and seconds spent by steps of one kind."""

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0
        self.steps = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps += 1

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class PayGuard:
    """Does drafting pay, as realized? Tokens per second of whole decode steps (drafting,
    verification, grammar work, the draft's catch-up of new sequences: all of it), with drafts
    and without, per key (the engine's: batch-size bucket and whether a row is constrained; the
    key's tail, here whether constrained, is its kind).

    AdaptiveK's cost model predicts; this measures. They disagree where the model leaves
    something out: under a JSON schema the verify pass also carries the text the grammar forces,
    the draft feeds it too, and the values drafts cover are where a draft guesses worst; a new
    sequence's first draft prefills its prompt on the draft model, a one-off the fit leaves out.

    While a key is undecided, its plain and drafting steps take turns (a drafting step after each
    plain step that is not the one right after drafting), so both are measured side by side over
    the same stretch of text. (Measured one after the other, plain steps from the start of JSON
    replies, which feed the text the grammar forces, against drafting steps from their middle,
    a guard can take a loss for a gain.) A decision needs min_steps plain steps. Drafting is
    refused at the key unless its steps emitted `margin` times as many tokens per second as plain
    ones (a machine's noise is as large as a small gain, and taking noise for a gain costs more
    than missing a small one: a guard that lets a losing drafting on pays that loss at every
    later step of the key): after min_steps of them, or already after
    recheck_steps when they emitted less than `early` times as many (a clear loss is not measured
    further: at a large batch under a schema a losing drafting step costs a multiple of a plain one).
    Every `recheck` refused steps (doubling after each recheck that does not pay, up to 16 times)
    the drafting side is forgotten, so the next recheck_steps steps draft again and are measured
    afresh: a recheck asks whether things changed.

    Batch sizes are ordered: verifying k + 1 positions costs more, against a plain step, the more
    rows share the pass. So a key not decided yet follows a refusal at a smaller batch-size bucket
    of its kind (where drafting did not pay, it does not pay with more rows) instead of paying to
    learn it again.

    And once drafting has been refused somewhere for a kind, trying it again (a recheck) or at a
    key of that kind not decided yet is paid from a budget: the seconds of such drafting steps stay
    under `budget` of all decode steps' seconds. A batch of JSON replies runs most of its steps
    at its full size and drains in a step or two per batch-size bucket; drafting in those few
    steps, for rows the draft must first catch up, can look like paying on a handful of noisy steps
    while it slows the whole run.
    """

    def __init__(self, decay: float = 0.97, min_steps: int = 8, recheck: int = 64, recheck_steps: int = 3,
                 early: float = 0.8, budget: float = 0.03, margin: float = 1.05) -> None:
        if not 0.0 < decay <= 1.0 or min(min_steps, recheck, recheck_steps) < 1 or not 0.0 <= early <= 1.0 \
                or not 0.0 <= budget <= 1.0 or margin < 1.0:
            raise ValueError(f"need 0 < decay <= 1, min_steps, recheck, recheck_steps >= 1, 0 <= early <= 1, "
                             f"0 <= budget <= 1 and margin >= 1; got {decay}, {min_steps}, {recheck}, "
                             f"{recheck_steps}, {early}, {budget}, {margin}")
        self.decay, self.min_steps, self.recheck, self.early, self.budget = decay, min_steps, recheck, early, budget
        self.margin = margin
        self.recheck_steps = min(recheck_steps, min_steps)
        self._needed: dict[tuple, int] = {}  # key -> drafting steps a decision needs (fewer after a recheck)
        self._rates: dict[tuple, tuple[_Rate, _Rate]] = {}  # key -> (plain steps, drafting steps)
        self._refused: dict[tuple, int] = {}  # key -> refused steps since the last recheck
        self._plain_run: dict[tuple, int] = {}  # key -> plain steps (as counted) since its last drafting one
        self._scale: dict[tuple, int] = {}  # key -> recheck interval multiplier
        self._spent: dict[tuple, float] = {}  # kind -> seconds of drafting steps tried after a refusal
        self._refusals: set[tuple] = set()  # kinds where drafting was refused somewhere
        self._seconds = 0.0  # all decode steps'
        self.num_refused = 0
        self._warm = False  # whether a step with drafts was seen (the first is left out)
        self._last = False  # whether the step before drafted
        self._trying: tuple | None = None  # the kind whose budget the last allowed drafting step is paid from

    def record(self, key: tuple, drafted: bool, tokens: int, seconds: float) -> None:
        """One decode step at `key`: whether it drafted, the tokens the target chose in it (not
        text a grammar forced), its seconds.

        A plain step right after a drafting step counts as drafting's: it feeds what the drafts
        left (when drafts stopped at forced text, such a plain step feeds that text, and costs more
        than a plain step after a plain one). The first step with drafts of the
        guard's life is left out: it pays one-off set-up (a draft deployment's data channel, set
        up through Ray on first use, which no later step pays again)."""
        last, self._last = self._last, drafted
        self._plain_run[key] = 0 if drafted or last else self._plain_run.get(key, 0) + 1
        self._seconds += seconds
        if (drafted or last) and self._trying is not None:
            self._spent[self._trying] = self._spent.get(self._trying, 0.0) + seconds
        if not drafted:
            self._trying = None
        if drafted and not self._warm:
            self._warm = True
            return
        self._rates.setdefault(key, (_Rate(), _Rate()))[drafted or last].add(tokens, seconds, self.decay)

    def allows(self, key: tuple) -> bool:
        """Whether a step at `key` may draft (the caller asks only when its model says k > 0)."""
        plain, drafting = self._rates.setdefault(key, (_Rate(), _Rate()))
        verdict = self._verdict(key)
        if verdict:
            self._scale[key] = 1
            return True
        if verdict is None:
            if self._refused_below(key) or not self._affordable(key):
                self.num_refused += 1
                return False
            if not self._plain_run.get(key):
                return False  # a plain step first: while undecided, plain and drafting steps take turns
            self._try(key)
            return True
        self.num_refused += 1
        self._refusals.add(key[1:])
        refused = self._refused[key] = self._refused.get(key, 0) + 1
        if refused >= self.recheck * self._scale.get(key, 1) and self._affordable(key):
            self._refused[key] = 0
            self._scale[key] = min(MAX_PROBE_SCALE, 2 * self._scale.get(key, 1))
            self._rates[key] = (plain, _Rate())  # measure drafting afresh
            self._needed[key] = self.recheck_steps
            self._try(key)
            return True
        return False

    def refused(self, key: tuple) -> bool:
        """Whether drafting at `key` was measured not to pay, there or at a smaller batch-size
        bucket of its kind (what `allows` then says until a recheck)."""
        return self._verdict(key) is False or self._refused_below(key)

    def _verdict(self, key: tuple) -> bool | None:
        """Whether drafting pays at key as measured; None while it is not measured enough to say."""
        plain, drafting = self._rates.get(key, (None, None))
        if plain is None or plain.steps < self.min_steps or drafting.steps < self.recheck_steps:
            return None
        if drafting.steps < self._needed.get(key, self.min_steps):
            return False if drafting.per_s < self.early * plain.per_s else None  # a clear loss already
        return drafting.per_s >= self.margin * plain.per_s

    def _refused_below(self, key: tuple) -> bool:
        """Whether drafting was measured not to pay at a smaller batch-size bucket of key's kind."""
        return any(k[0] < key[0] and k[1:] == key[1:] and self._verdict(k) is False for k in self._rates)

    def _affordable(self, key: tuple) -> bool:
        """Whether drafting at key is free to try: nowhere of its kind was it refused, or what
        tries after refusals spent is within budget."""
        kind = key[1:]
        return kind not in self._refusals or self._spent.get(kind, 0.0) <= self.budget * self._seconds

    def _try(self, key: tuple) -> None:
        """The coming drafting step is paid from key's kind's budget when its kind saw a refusal."""
        if key[1:] in self._refusals:
            self._trying = key[1:]

    def rates(self, key: tuple) -> tuple[float, float]:
        """(plain, drafting) tokens per second at key, as measured (0: nothing yet)."""
        plain, drafting = self._rates.get(key, (_Rate(), _Rate()))
        return plain.per_s, drafting.per_s
