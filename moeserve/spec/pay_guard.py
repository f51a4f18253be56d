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
    verification, grammar work, the draft's catch-up of new sequences and forced text: all of
    it), with drafts and without, per key (the engine's: batch-size bucket and whether a row is
    constrained).

    AdaptiveK's cost model predicts; this measures. They disagree where the model leaves
    something out: under a JSON schema a draft stops where the grammar forces text, so proposals
    are shorter than k and the formula's tokens per pass overstate them, and a new sequence's
    first draft prefills its prompt on the draft model, a one-off the fit leaves out. When steps
    with drafts have emitted fewer tokens per second than plain steps (both measured, min_steps
    each; a key that has drafted min_steps steps and has fewer plain ones runs plain steps
    until it has them), drafting is refused at that key. Every `recheck` refused steps
    (doubling after each recheck that does not pay, up to 16 times) the drafting side is
    forgotten, so the next recheck_steps steps (at most min_steps) draft again and are measured
    afresh: a recheck asks whether things changed, and where drafting loses (a draft deployment
    at 32 rows: steps of 20-70 ms with drafts, ~6 ms without) each of its steps costs.
    """

    def __init__(self, decay: float = 0.97, min_steps: int = 8, recheck: int = 64, recheck_steps: int = 3) -> None:
        if not 0.0 < decay <= 1.0 or min_steps < 1 or recheck < 1 or recheck_steps < 1:
            raise ValueError(f"need 0 < decay <= 1 and min_steps, recheck, recheck_steps >= 1; got {decay}, "
                             f"{min_steps}, {recheck}, {recheck_steps}")
        self.decay, self.min_steps, self.recheck = decay, min_steps, recheck
        self.recheck_steps = min(recheck_steps, min_steps)
        self._needed: dict[tuple, int] = {}  # key -> drafting steps a decision needs (fewer after a recheck)
        self._rates: dict[tuple, tuple[_Rate, _Rate]] = {}  # key -> (plain steps, drafting steps)
        self._refused: dict[tuple, int] = {}  # key -> refused steps since the last recheck
        self._scale: dict[tuple, int] = {}  # key -> recheck interval multiplier
        self.num_refused = 0
        self._warm = False  # whether a step with drafts was seen (the first is left out)
        self._last = False  # whether the step before drafted

    def record(self, key: tuple, drafted: bool, tokens: int, seconds: float) -> None:
        """One decode step at `key`: whether it drafted, the tokens the target chose in it (not
        text a grammar forced), its seconds.

        A plain step right after a drafting step counts as drafting's: it feeds what the drafts
        stopped short of (a draft ends where its grammar forces text, and the next step feeds
        that text; under the demo schema at 8 rows such a plain step took 8.4 ms, against 4.5 ms
        after a plain one). Counted as plain, these steps made plain decoding look dear next to
        drafting and kept drafting on where whole runs were 0.8x; left out, the cost was
        nobody's and alternating kept it on as well. The first step with drafts of the guard's
        life is left out: it pays one-off set-up (a draft deployment's data channel, set up
        through Ray on first use, costs tens of plain steps)."""
        last, self._last = self._last, drafted
        if drafted and not self._warm:
            self._warm = True
            return
        self._rates.setdefault(key, (_Rate(), _Rate()))[drafted or last].add(tokens, seconds, self.decay)

    def allows(self, key: tuple) -> bool:
        """Whether a step at `key` may draft (the caller asks only when its model says k > 0)."""
        plain, drafting = self._rates.get(key, (None, None))
        if plain is None or drafting.steps < self._needed.get(key, self.min_steps):
            return True
        if plain.steps < self.min_steps:  # drafting measured, plain steps not yet: measure them
            return False
        if drafting.per_s >= plain.per_s:
            self._scale[key] = 1
            return True
        self.num_refused += 1
        refused = self._refused[key] = self._refused.get(key, 0) + 1
        if refused >= self.recheck * self._scale.get(key, 1):
            self._refused[key] = 0
            self._scale[key] = min(MAX_PROBE_SCALE, 2 * self._scale.get(key, 1))
            self._rates[key] = (plain, _Rate())  # measure drafting afresh
            self._needed[key] = self.recheck_steps
            return True
        return False

    def rates(self, key: tuple) -> tuple[float, float]:
        """(plain, drafting) tokens per second at key, as measured (0: nothing yet)."""
        plain, drafting = self._rates.get(key, (_Rate(), _Rate()))
        return plain.per_s, drafting.per_s
