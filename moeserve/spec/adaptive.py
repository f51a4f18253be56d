"""Adaptive k: how many tokens to draft for each sequence, from what drafting has earned it.

If each draft token is accepted with probability alpha (given the ones before it were),
drafting k tokens yields (1 - alpha^(k+1)) / (1 - alpha) tokens per target pass in
expectation. Drafting costs time, though: the draft runs k steps and the target scores
k + 1 positions instead of 1. AdaptiveK picks the k that maximises tokens per second.

What a position costs depends on the batch: at one row a pass is nearly all fixed cost, so
verifying k + 1 positions is almost free; at 32 rows the pass is already busy, and k + 1
positions cost nearly k + 1 times as much. So the costs are measured and kept per batch-size
bucket (1, 2-3, 4-7, 8-15, ...), and a batch's k comes from its own bucket's costs: speculation
stops by itself where it stops paying, instead of at a fixed batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def expected_tokens_per_pass(alpha: float, k: float) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens one target pass emits with k drafts.

    The accepted prefix is geometric (each draft survives with probability alpha), and the
    pass always adds one recovered or bonus token. Tends to k + 1 as alpha -> 1; k may be a
    mean (non-integer).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha > 1.0 - 1e-9:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


@dataclass(frozen=True)
class CostModel:
    """Measured per-sequence step costs (seconds), a linear model the engine refits.

    A target pass over t tokens of one sequence costs target_base_s + target_per_token_s * t
    (target_base_s is this sequence's share of the fixed per-step cost: weights read,
    launches, a Ray-free loop). Drafting costs draft_per_token_s per draft token, plus
    draft_base_s whenever the sequence drafts at all (the draft's catch-up forward, or the
    call to a remote draft deployment).
    """

    target_base_s: float
    target_per_token_s: float
    draft_per_token_s: float
    draft_base_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("target_base_s", "target_per_token_s", "draft_per_token_s", "draft_base_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.target_base_s + self.target_per_token_s <= 0:
            raise ValueError("a target pass must cost something: target_base_s + target_per_token_s > 0")

    def step_cost(self, k: int) -> float:
        """Seconds for one speculative step with k draft tokens (k = 0: plain decoding)."""
        draft = self.draft_base_s + self.draft_per_token_s * k if k > 0 else 0.0
        return self.target_base_s + self.target_per_token_s * (k + 1) + draft


@dataclass(frozen=True)
class AdaptiveKConfig:
    """How AdaptiveK chooses k.

    k_max: the largest k offered.
    decay: weight a sequence's own acceptance evidence keeps per step (an EMA
        over accepted and tried counts).
    prior_alpha, prior_weight: the belief before any observation, as pseudo-trials. A sequence's
        estimate leans on the pool's running alpha (all sequences, EMA with pool_decay) by
        prior_weight pseudo-trials, so a new one starts there and an idle one drifts back there.
    probe_every: after this many steps at k = 0, draft one token anyway, so a sequence
        whose text turned formulaic can win k back.
    probe_budget: when set, probes are also spaced so that they cost at most this fraction
        of the plain steps between them (at 0.05, a probe that costs as much as 15 plain
        steps comes every 300 plain steps, not every probe_every).
    explore_every: while a batch-size bucket drafts, every this many of its steps is plain
        (k = 0), two in a row (the first feeds what the drafts left; the second is a plain step as
        plain steps are, which PayGuard keeps measuring drafting against), and so are its 4th, 8th,
        16th, ... drafting steps before that, so its costs are measured at two widths and the slope
        of a position is known (0: never).
    """

    k_max: int = 8
    decay: float = 0.8
    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    probe_every: int = 16
    pool_decay: float = 0.99
    probe_budget: float | None = None
    explore_every: int = 0

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")
        for name in ("decay", "pool_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must lie in [0, 1], got {self.prior_alpha}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if self.explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {self.explore_every}")
        if self.probe_budget is not None and not 0.0 < self.probe_budget <= 1.0:
            raise ValueError(f"probe_budget must lie in (0, 1] or be None, got {self.probe_budget}")


class _Acceptance:
    """Decayed counts of draft tokens accepted and of acceptance trials.

    A sequence's estimate leans on a prior (the pool's running alpha) by `weight` pseudo-trials,
    and its own evidence ages by `decay` at every step, drafting or not: what a stretch of text
    said about acceptance fades as the text moves on. So a sequence that stopped drafting after a
    run of rejections drifts back to the pool's alpha and drafts again, instead of keeping k = 0
    on the word of five old rejections until a probe."""

    def __init__(self) -> None:
        self.accepted = self.trials = 0.0

    def alpha(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.trials + weight)

    def age(self, decay: float) -> None:
        self.accepted *= decay
        self.trials *= decay

    def update(self, num_proposed: int, num_accepted: int, decay: float, cut: bool = False) -> None:
        # Each accepted token is a trial that succeeded; the first rejection is one that
        # failed; drafts after it were never tried. Counting them as failures (accepted /
        # proposed) would underestimate alpha, and the formula would then disagree. A proposal
        # cut short (cut) ends a pass as a rejection does, so its end is a failed trial too.
        trials = num_accepted + (1 if num_accepted < num_proposed or cut else 0)
        self.age(decay)
        self.accepted += num_accepted
        self.trials += trials


MAX_PROBE_SCALE = 16  # a bucket where drafting never pays probes at most every 16 probe intervals


def bucket(num_rows: int) -> int:
    """The batch-size bucket of num_rows: 1, 2-3, 4-7, 8-15, ... are buckets 1, 2, 3, 4, ..."""
    return max(1, num_rows).bit_length()


class AdaptiveK:
    """k for a batch from its rows' running acceptance rates and the costs measured at its size.

    Per step: `choose_batch(seq_ids)` (or `choose_k(seq_id)` for a batch of one) before
    proposing, `observe(seq_id, proposed, accepted)` after verification, `on_finished(seq_id)`
    when the sequence ends. `set_costs` takes the engine's refitted cost model for a bucket
    (or the default, used where a bucket has none and no other bucket is known).
    """

    def __init__(self, config: AdaptiveKConfig, costs: CostModel) -> None:
        self.config = config
        self.costs = costs
        self._bucket_costs: dict[int, CostModel] = {}
        self._pool = _Acceptance()
        self._seqs: dict[str, _Acceptance] = {}
        self._steps_at_zero: dict[int, int] = {}  # per bucket: consecutive plain steps
        self._steps_drafting: dict[int, int] = {}  # per bucket: consecutive drafting steps
        self._probe_scale: dict[int, int] = {}  # per bucket: probes that did not win k back stretch the interval
        self._probed: set[int] = set()  # buckets whose last step was a probe

    def set_costs(self, costs: CostModel, num_rows: int | None = None) -> None:
        """Replaces the cost model of num_rows' bucket (None: the default)."""
        if num_rows is None:
            self.costs = costs
        else:
            self._bucket_costs[bucket(num_rows)] = costs

    def costs_for(self, num_rows: int) -> CostModel:
        """The costs of num_rows' bucket, else of the nearest bucket measured, else the default."""
        if not self._bucket_costs:
            return self.costs
        b = bucket(num_rows)
        return self._bucket_costs[min(self._bucket_costs, key=lambda k: (abs(k - b), k))]

    def alpha(self, seq_id: str) -> float:
        """The sequence's running acceptance estimate (the pool's for unknown ids)."""
        return self._alpha(self._seqs.get(seq_id))

    def best_k(self, alpha: float, costs: CostModel | None = None) -> int:
        """argmax over k in [0, k_max] of expected tokens per second; ties go to smaller k."""
        return self.best_batch_k([alpha], costs)

    def best_batch_k(self, alphas: list[float], costs: CostModel | None = None) -> int:
        """The one k for a batch whose rows accept with these alphas: the target pass is as wide
        as its widest row, so every row pays for k + 1 positions. argmax over k of the batch's
        expected tokens per second; ties go to smaller k."""
        costs = costs or self.costs
        best, best_rate = 0, 0.0
        tokens, powers = float(len(alphas)), [1.0] * len(alphas)  # at k: sum of 1 + a + ... + a^k; a^k
        for k in range(self.config.k_max + 1):
            if k:  # expected_tokens_per_pass summed over the rows, incrementally (this runs every step)
                powers = [p * a for p, a in zip(powers, alphas)]
                tokens += sum(powers)
            rate = tokens / costs.step_cost(k)
            if rate > best_rate * (1.0 + 1e-9):
                best, best_rate = k, rate
        return best

    def choose_batch(self, seq_ids: list[str]) -> list[int]:
        """k for each row of this step's batch; 0 means decode it without speculation.

        When no row drafts, every probe interval all rows draft one token (a probe), so
        acceptance and the cost of drafting at this batch size stay measured (each probe that
        does not win k back doubles the bucket's interval, up to MAX_PROBE_SCALE); while rows
        draft, every explore_every-th step is plain, so the cost of a plain pass does too."""
        n = len(seq_ids)
        b = bucket(n)
        states = [self._state(s) for s in seq_ids]
        k = self.best_batch_k([self._alpha(s) for s in states], self.costs_for(n))
        if self.config.k_max == 0 or n == 0:
            return [k] * n
        if k == 0:
            self._steps_drafting[b] = 0
            if b in self._probed:  # the probe did not win k back: wait longer for the next one
                self._probed.discard(b)
                self._probe_scale[b] = min(MAX_PROBE_SCALE, 2 * self._probe_scale.get(b, 1))
            self._steps_at_zero[b] = self._steps_at_zero.get(b, 0) + 1
            if self._steps_at_zero[b] >= self.probe_interval(n) * self._probe_scale.get(b, 1):
                self._steps_at_zero[b] = 0
                self._probed.add(b)
                return [1] * n
            for state in states:  # a plain step: the rows' evidence ages toward the pool's alpha
                state.age(self.config.decay)
            return [0] * n
        self._probed.discard(b)
        self._probe_scale[b] = 1
        self._steps_at_zero[b] = 0
        d = self._steps_drafting[b] = self._steps_drafting.get(b, 0) + 1
        every = self.config.explore_every
        # plain steps at drafting steps 4, 8, 16, ... up to explore_every, then two every explore_every:
        # a new bucket measures a plain pass early, before its first refits
        if every and (d % every == 0 or (d > every and d % every == 1) or (4 <= d < every and d & (d - 1) == 0)):
            return [0] * n
        return [k] * n

    def probing(self, num_rows: int) -> bool:
        """Whether the last step chosen for num_rows' bucket was a probe."""
        return bucket(num_rows) in self._probed

    def choose_k(self, seq_id: str) -> int:
        """k for this sequence's next step as a batch of one."""
        return self.choose_batch([seq_id])[0]

    def probe_interval(self, num_rows: int = 1) -> int:
        """Plain steps between probes: probe_every, or more when a probe is dear (probe_budget)."""
        every = self.config.probe_every
        if self.config.probe_budget is None:
            return every
        costs = self.costs_for(num_rows)
        extra = costs.step_cost(1) - costs.step_cost(0)  # what one probe adds to a step
        return max(every, math.ceil(extra / (self.config.probe_budget * costs.step_cost(0))))

    def observe(self, seq_id: str, num_proposed: int, num_accepted: int, cut: bool = False) -> None:
        """Records one verification: num_proposed drafted (what the proposer actually
        returned, which may be fewer than k), num_accepted of them kept.

        cut: the proposal was shorter than asked for a reason that ends the pass there (under a
        grammar: a draft token it refused, which the engine cut, or the output's end). Such a
        pass ends as if its next draft had been refused, so the end counts as a failed trial:
        alpha then estimates what a pass yields, P(accepted and not cut) per draft token. (When
        drafts stopped where a grammar forces text, before they drafted through it, they were
        mostly accepted under the demo's JSON schema but cut every few tokens, and counted as
        accepted they made k = 8 look worth far more tokens a pass than it yielded.)"""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"need 0 <= num_accepted <= num_proposed, got {num_accepted}, {num_proposed}")
        if num_proposed == 0 and not cut:
            return
        self._state(seq_id).update(num_proposed, num_accepted, self.config.decay, cut)
        self._pool.update(num_proposed, num_accepted, self.config.pool_decay, cut)

    def on_finished(self, seq_id: str) -> None:
        """Forgets the sequence."""
        self._seqs.pop(seq_id, None)

    def _alpha(self, state: _Acceptance | None) -> float:
        """A sequence's estimate (None: the pool's), leaning on the pool's alpha, which leans on
        the configured prior."""
        pool = self._pool.alpha(self.config.prior_alpha, self.config.prior_weight)
        return pool if state is None else state.alpha(pool, self.config.prior_weight)

    def _state(self, seq_id: str) -> _Acceptance:
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _Acceptance()
        return state

