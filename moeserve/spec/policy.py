"""Speculation policy: how many tokens each decode step drafts.

With per-token acceptance alpha, k drafts yield (1 - alpha^(k+1)) / (1 - alpha) tokens per target
pass but cost k draft steps and k + 1 verified positions. `AdaptiveK` picks the k with the most
expected tokens per second from each row's acceptance and the step costs measured per batch-size
bucket (`StepCostMeter`): one row's pass is nearly all fixed cost, 32 rows' k + 1 positions cost
nearly k + 1 passes. The model does not see forced text (under a JSON schema a plain pass also
emits it), so `PayGuard` checks the realized rate and refuses drafting where it lost.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from moeserve.config import SpeculativeSection, default_of


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: `num_tokens` draft tokens per step (the cap when `adaptive`); no
    speculation while `disable_by_batch_size` or more sequences run (0: never)."""

    num_tokens: int = 4
    adaptive: bool = False
    disable_by_batch_size: int = default_of(SpeculativeSection, "disable_by_batch_size")

    def __post_init__(self) -> None:
        if not 0 <= self.num_tokens <= 16 or self.disable_by_batch_size < 0:
            raise ValueError(f"need 0 <= num_tokens <= 16 and disable_by_batch_size >= 0; got "
                             f"{self.num_tokens}, {self.disable_by_batch_size}")


@dataclass(frozen=True)
class CostModel:
    """Per-sequence step costs (seconds): a target pass over t positions costs target_base_s +
    target_per_token_s * t; drafting k tokens costs draft_base_s + draft_per_token_s * k."""

    target_base_s: float
    target_per_token_s: float
    draft_per_token_s: float
    draft_base_s: float = 0.0

    def __post_init__(self) -> None:
        costs = (self.target_base_s, self.target_per_token_s, self.draft_per_token_s, self.draft_base_s)
        if min(costs) < 0 or self.target_base_s + self.target_per_token_s <= 0:
            raise ValueError(f"costs must be >= 0 and a target pass must cost something, got {costs}")

    def step_cost(self, k: int) -> float:
        """Seconds for one speculative step with k draft tokens (k = 0: plain decoding)."""
        draft = self.draft_base_s + self.draft_per_token_s * k if k > 0 else 0.0
        return self.target_base_s + self.target_per_token_s * (k + 1) + draft


# Relative costs before anything is measured: a draft token ~1/10 of a target pass.
PRIOR_COSTS = CostModel(target_base_s=1e-2, target_per_token_s=1e-4, draft_per_token_s=1e-3, draft_base_s=1e-3)


def bucket(num_rows: int) -> int:
    """The batch-size bucket of num_rows: 1, 2-3, 4-7, 8-15, ... are buckets 1, 2, 3, 4, ..."""
    return max(1, num_rows).bit_length()


class StepCostMeter:
    """A window of recent decode steps per batch-size bucket, and the CostModel they imply: per
    sequence, target_s / B ~ base + slope * (K + 1) and draft_s / B ~ base + slope * K (least
    squares). With one width only, the target keeps the prior's slope and drafting is charged per
    token (so adaptive k tries narrower k, and a second width gets measured)."""

    def __init__(self, window: int = 256) -> None:
        self._steps: dict[int, deque[tuple[int, int, float, float]]] = {}  # (rows, width, draft_s, target_s)
        self._counts: dict[int, int] = {}  # per bucket: steps recorded (the windows keep the last `window`)
        self.window = window

    def record(self, num_rows: int, width: int, draft_s: float, target_s: float) -> None:
        """Adds one decode step (width 0: a step without drafts)."""
        b = bucket(num_rows)
        self._steps.setdefault(b, deque(maxlen=self.window)).append((num_rows, width, draft_s, target_s))
        self._counts[b] = self._counts.get(b, 0) + 1

    def num_recorded_at(self, num_rows: int) -> int:
        return self._counts.get(bucket(num_rows), 0)

    def fit(self, prior: CostModel, num_rows: int) -> CostModel:
        """Per-sequence costs from num_rows' bucket; the prior where the window says nothing."""
        steps = self._steps.get(bucket(num_rows), ())
        base, slope = _fit_line([(w + 1, t / n) for n, w, _, t in steps], (prior.target_base_s, prior.target_per_token_s))
        draft = _fit_line([(w, d / n) for n, w, d, _ in steps if w > 0], (prior.draft_base_s, prior.draft_per_token_s),
                          per_unit=True)
        return CostModel(base if base + slope > 0 else prior.target_base_s, slope, draft[1], draft[0])


def _fit_line(points: list[tuple[int, float]], prior: tuple[float, float], per_unit: bool = False) -> tuple[float, float]:
    """(intercept, slope) of y ~ a + b x, both >= 0. With one x only: all of y per unit of x
    (per_unit), else the prior's slope."""
    if not points:
        return prior
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx < 1e-9 and per_unit and mx > 0:
        return 0.0, my / mx
    slope = prior[1] if sxx < 1e-9 else max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx)
    return max(0.0, my - slope * mx), slope


class PayGuard:
    """Does drafting pay, as realized? The median tokens per second of the last `window` decode
    steps with drafts and of those without, per key (batch-size bucket, constrained or not): a
    median, so one step stalled by something else (a collection, a busy neighbour) does not decide.
    Until both kinds have min_steps steps they take turns (same text, same load); then drafting is
    refused where its median is lower, and measured afresh after `recheck` refused steps; each
    recheck that loses again doubles the wait before the next (up to `max_wait`), a win resets it."""

    def __init__(self, window: int = 32, min_steps: int = 8, recheck: int = 64, max_wait: int = 1024) -> None:
        if not 1 <= min_steps <= window or not 1 <= recheck <= max_wait:
            raise ValueError(f"need 1 <= min_steps <= window, 1 <= recheck <= max_wait; got {window}, {min_steps}, "
                             f"{recheck}, {max_wait}")
        self.window, self.min_steps, self.recheck, self.max_wait = window, min_steps, recheck, max_wait
        self._rates: dict[tuple, tuple[deque, deque]] = {}  # key -> recent (plain, drafting) steps' tokens/s
        self._refused: dict[tuple, int] = {}  # key -> refused steps since the last recheck
        self._wait: dict[tuple, int] = {}  # key -> refused steps before the next recheck
        self._last = False  # whether the last step drafted
        self.num_refused = 0

    def record(self, key: tuple, drafted: bool, tokens: int, seconds: float) -> None:
        """One decode step at `key`: whether it drafted, the tokens the target chose, its seconds."""
        self._last = drafted
        if seconds > 0:
            self._kinds(key)[drafted].append(tokens / seconds)

    def allows(self, key: tuple) -> bool:
        """Whether a step at `key` may draft (asked only where the model says k > 0)."""
        plain, drafting = self._kinds(key)
        if min(len(plain), len(drafting)) < self.min_steps:  # undecided: take turns
            return not self._last
        if statistics.median(drafting) >= statistics.median(plain):
            self._wait[key] = self.recheck
            return True
        self.num_refused += 1
        self._refused[key] = self._refused.get(key, 0) + 1
        wait = self._wait.setdefault(key, self.recheck)
        if self._refused[key] >= wait:
            self._refused[key] = 0
            self._wait[key] = min(2 * wait, self.max_wait)  # a loss again: the next recheck waits longer
            drafting.clear()  # measure drafting afresh
            return True
        return False

    def _kinds(self, key: tuple) -> tuple[deque, deque]:
        return self._rates.setdefault(key, (deque(maxlen=self.window), deque(maxlen=self.window)))


@dataclass(frozen=True)
class AdaptiveKConfig:
    """How AdaptiveK chooses k (at most k_max). decay, pool_decay: weight a sequence's (the pool's)
    acceptance evidence keeps per step; prior_weight: pseudo-trials at the pool's alpha (the pool's
    at prior_alpha). probe_every: after this many steps at k = 0, draft one token anyway."""

    k_max: int = 8
    decay: float = 0.8
    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    probe_every: int = 16
    pool_decay: float = 0.99

    def __post_init__(self) -> None:
        if (self.k_max < 0 or not 0.0 < self.decay <= 1.0 or not 0.0 < self.pool_decay <= 1.0
                or not 0.0 <= self.prior_alpha <= 1.0 or self.prior_weight <= 0 or self.probe_every < 1):
            raise ValueError(f"invalid {self}: need k_max >= 0, decay and pool_decay in (0, 1], prior_alpha in "
                             "[0, 1], prior_weight > 0, probe_every >= 1")


class _Acceptance:
    """Decayed counts of draft tokens accepted and of acceptance trials; the evidence ages at every
    step, drafting or not, so what a stretch of text said fades as the text moves on."""

    def __init__(self) -> None:
        self.accepted = self.trials = 0.0

    def alpha(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.trials + weight)

    def age(self, decay: float) -> None:
        self.accepted *= decay
        self.trials *= decay

    def update(self, num_proposed: int, num_accepted: int, decay: float, cut: bool = False) -> None:
        # Accepted tokens are trials that succeeded; the first rejection (or cut) one that failed.
        self.age(decay)
        self.accepted += num_accepted
        self.trials += num_accepted + (1 if num_accepted < num_proposed or cut else 0)


class AdaptiveK:
    """k for a batch from its rows' running acceptance and the costs measured at its size, checked
    by a PayGuard. Per decode step: `choose_batch` before proposing, `observe` per row after
    verification, `record` with the step's times and tokens; `on_finished` when a sequence ends.
    A bucket's costs are refit every `refit_every` of its steps."""

    def __init__(self, config: AdaptiveKConfig, costs: CostModel = PRIOR_COSTS, refit_every: int = 16) -> None:
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self.config, self.costs, self.refit_every = config, costs, refit_every
        self.meter = StepCostMeter()
        self.guard = PayGuard()
        self._bucket_costs: dict[int, CostModel] = {}
        self._pool = _Acceptance()
        self._seqs: dict[str, _Acceptance] = {}
        self._steps_at_zero: dict[int, int] = {}  # per bucket: consecutive plain steps

    def set_costs(self, costs: CostModel, num_rows: int | None = None) -> None:
        """Replaces the cost model of num_rows' bucket (None: the default)."""
        if num_rows is None:
            self.costs = costs
        else:
            self._bucket_costs[bucket(num_rows)] = costs

    def costs_for(self, num_rows: int) -> CostModel:
        """The costs of num_rows' bucket, else the default."""
        return self._bucket_costs.get(bucket(num_rows), self.costs)

    def alpha(self, seq_id: str) -> float:
        """The sequence's running acceptance estimate (the pool's for unknown ids)."""
        return self._alpha(self._seqs.get(seq_id))

    def best_batch_k(self, alphas: list[float], costs: CostModel | None = None) -> int:
        """The one k for a batch whose rows accept with these alphas (the pass is as wide as its
        widest row, so every row pays for k + 1 positions): argmax of the batch's expected tokens
        per second; ties go to smaller k."""
        costs = costs or self.costs
        best, best_rate = 0, 0.0
        tokens, powers = float(len(alphas)), [1.0] * len(alphas)  # at k: sum of 1 + a + ... + a^k; a^k
        for k in range(self.config.k_max + 1):
            if k:
                powers = [p * a for p, a in zip(powers, alphas)]
                tokens += sum(powers)
            rate = tokens / costs.step_cost(k)
            if rate > best_rate * (1.0 + 1e-9):
                best, best_rate = k, rate
        return best

    def choose_batch(self, seq_ids: list[str], constrained: bool = False) -> list[int]:
        """k for each row of this step's batch (one k for all; 0: a plain step). After probe_every
        plain steps all rows draft one token (a probe); a drafting step is refused where the guard
        saw drafting not pay (`constrained`: whether a row has a grammar, part of its key)."""
        n, b = len(seq_ids), bucket(len(seq_ids))
        states = [self._state(s) for s in seq_ids]
        k = self.best_batch_k([self._alpha(s) for s in states], self.costs_for(n))
        if self.config.k_max == 0 or n == 0:
            return [k] * n
        if k == 0:
            self._steps_at_zero[b] = self._steps_at_zero.get(b, 0) + 1
            if self._steps_at_zero[b] >= self.config.probe_every:
                self._steps_at_zero[b] = 0
                k = 1
            else:
                for state in states:  # a plain step: the rows' evidence ages toward the pool's alpha
                    state.age(self.config.decay)
        else:
            self._steps_at_zero[b] = 0
        if k and not self.guard.allows((b, constrained)):
            k = 0
        return [k] * n

    def observe(self, seq_id: str, num_proposed: int, num_accepted: int, cut: bool = False) -> None:
        """One verification: num_proposed drafted, num_accepted of them kept. cut: the proposal
        ended short where the pass ends anyway (a draft its grammar refused, or the output's end),
        which counts as a failed trial, so alpha estimates what a pass yields."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"need 0 <= num_accepted <= num_proposed, got {num_accepted}, {num_proposed}")
        if num_proposed == 0 and not cut:
            return
        self._state(seq_id).update(num_proposed, num_accepted, self.config.decay, cut)
        self._pool.update(num_proposed, num_accepted, self.config.pool_decay, cut)

    def record(self, num_rows: int, constrained: bool, width: int, draft_s: float, target_s: float, tokens: int,
               seconds: float) -> None:
        """A decode step: its widest proposal (0: plain), drafting and target seconds (for the
        costs), and the tokens the target chose and the whole step's seconds (for the guard)."""
        self.meter.record(num_rows, width, draft_s, target_s)
        if self.meter.num_recorded_at(num_rows) % self.refit_every == 0:
            self.set_costs(self.meter.fit(self.costs_for(num_rows), num_rows), num_rows)
        self.guard.record((bucket(num_rows), constrained), width > 0, tokens, seconds)

    def on_finished(self, seq_id: str) -> None:
        """Forgets the sequence."""
        self._seqs.pop(seq_id, None)

    def _alpha(self, state: _Acceptance | None) -> float:  # None: the pool's
        pool = self._pool.alpha(self.config.prior_alpha, self.config.prior_weight)
        return pool if state is None else state.alpha(pool, self.config.prior_weight)

    def _state(self, seq_id: str) -> _Acceptance:
        return self._seqs.setdefault(seq_id, _Acceptance())
