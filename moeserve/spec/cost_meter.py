"""Measured step times -> the CostModel that adaptive k optimises.

The engine times each decode step: drafting (the proposer call) and the target pass.
Per sequence of a B-row batch whose widest row drafts K tokens:

- the target pass feeds K + 1 positions in every row (rows are padded to the widest), so
  target_s / B ~ target_base_s + target_per_token_s * (K + 1);
- drafting runs K sequential draft forwards (the first also catches up), so
  draft_s / B ~ draft_base_s + draft_per_token_s * K.

`fit` solves both lines by least squares over a window of recent steps of one batch-size
bucket (the per-row costs at 1 row and at 32 differ several-fold; adaptive.bucket). When the window
holds one width only, a slope cannot be measured. For the target pass (fixed k, no plain
steps) the prior's slope is kept and only the intercept is fitted. For drafting, the whole time
is counted per draft token: keeping the prior's slope there let one degenerate fit (slope 0, so
k = 8 looked free) keep every later step at k = 8, where the split was never measured again;
counted per token, wider k look dearer, adaptive k tries narrower ones, and two widths measure
the split. A proposer whose time is mostly per call (`Proposer.cost_per_call`: a draft
deployment, whose worker drafts ahead while the target verifies, so a call costs its round trip
and rarely k draft passes) is counted per call instead: counted per token, its k = 1 probes
(one round trip for one token) made every wider k look several times dearer than it was, and
adaptive k never drafted again. For such a proposer a probe's drafting is also left out of the
draft fit: a probe follows plain steps, so the worker could not draft it ahead and first catches
up on the tokens they wrote, which steady drafting does not pay (counted, that catch-up alone
can hold a served deployment at k = 0 for good); its acceptance and its target pass still
count. (An in-process draft keeps its probes in the fit: there the probes' costs are real, and
left out they make wide batches look cheaper to draft than they are.) One-off stalls (a draft
deployment's channel being set up, a long prefill of a new sequence, a pause of the process)
would set the costs for the next hundred steps, so steps more than OUTLIER times the window's
median per-row time are left out of each fit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moeserve.spec.adaptive import CostModel, bucket

OUTLIER = 4.0  # a step this many times the median (per row) is a one-off, not the cost of drafting

# Relative costs before anything is measured: a draft token ~1/10 of a target pass.
PRIOR_COSTS = CostModel(target_base_s=1e-2, target_per_token_s=1e-4, draft_per_token_s=1e-3, draft_base_s=1e-3)


@dataclass(frozen=True)
class StepTiming:
    """One decode step: B rows, the widest row's draft tokens K (0: plain), seconds spent."""

    num_rows: int
    width: int
    draft_s: float
    target_s: float
    probe: bool = False  # a per-call draft's probe after plain steps: its drafting is left out of the fit

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.width < 0:
            raise ValueError(f"need num_rows >= 1 and width >= 0, got {self.num_rows}, {self.width}")
        if self.draft_s < 0 or self.target_s < 0:
            raise ValueError("times must be >= 0")


class StepCostMeter:
    """A window of recent step timings per batch-size bucket, and the cost model they imply."""

    def __init__(self, window: int = 256) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.window = window
        self._steps: dict[int, deque[StepTiming]] = {}
        self._counts: dict[int, int] = {}  # per bucket: steps recorded so far (the windows keep the last `window`)

    def record(self, num_rows: int, width: int, draft_s: float, target_s: float, probe: bool = False) -> None:
        """Adds one decode step (width 0 for a step without drafts; probe: a step whose target
        pass counts but whose drafting does not, a per-call draft's probe)."""
        step = StepTiming(num_rows, width, draft_s, target_s, probe)
        b = bucket(num_rows)
        self._steps.setdefault(b, deque(maxlen=self.window)).append(step)
        self._counts[b] = self._counts.get(b, 0) + 1

    @property
    def num_recorded(self) -> int:
        """Steps recorded so far, all buckets."""
        return sum(self._counts.values())

    def num_recorded_at(self, num_rows: int) -> int:
        """Steps recorded so far in num_rows' bucket."""
        return self._counts.get(bucket(num_rows), 0)

    def fit(self, prior: CostModel = PRIOR_COSTS, num_rows: int | None = None,
            draft_per_call: bool = False) -> CostModel:
        """Per-sequence costs from num_rows' bucket (None: every step in the windows); the
        prior where the window says nothing. draft_per_call: drafting measured at one width is
        counted per call, not per draft token."""
        if num_rows is None:
            window = [s for steps in self._steps.values() for s in steps]
        else:
            window = list(self._steps.get(bucket(num_rows), ()))
        steps = _typical(window, lambda s: s.target_s / s.num_rows)
        target = _fit_line(
            [s.width + 1 for s in steps], [s.target_s / s.num_rows for s in steps],
            (prior.target_base_s, prior.target_per_token_s),
        )
        drafted = _typical([s for s in window if s.width > 0 and not s.probe], lambda s: s.draft_s / s.num_rows)
        draft = _fit_line(
            [s.width for s in drafted], [s.draft_s / s.num_rows for s in drafted],
            (prior.draft_base_s, prior.draft_per_token_s), one_width="per_call" if draft_per_call else "per_token",
        )
        base, per_token = target
        if base + per_token <= 0:  # a target pass must cost something
            base = prior.target_base_s
        return CostModel(base, per_token, draft_per_token_s=draft[1], draft_base_s=draft[0])


def _typical(steps: list[StepTiming], per_row) -> list[StepTiming]:
    """The steps whose per-row time is at most OUTLIER times the median (all of them when few)."""
    if len(steps) < 4:
        return steps
    times = sorted(per_row(s) for s in steps)
    limit = OUTLIER * times[len(times) // 2]
    return [s for s in steps if per_row(s) <= limit]


def _fit_line(xs: list[int], ys: list[float], prior: tuple[float, float],
              one_width: str = "prior") -> tuple[float, float]:
    """(intercept, slope) of y ~ a + b x by least squares, both clamped at >= 0. With one x only,
    by `one_width`: the prior's slope ("prior"), all of y per unit of x ("per_token", x > 0), or
    all of it the intercept ("per_call")."""
    if not xs:
        return prior
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx < 1e-9 and one_width == "per_token" and mx > 0:
        return 0.0, my / mx
    if sxx < 1e-9 and one_width == "per_call":
        return my, 0.0
    if sxx < 1e-9:
        slope = prior[1]
    else:
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
    return max(0.0, my - slope * mx), slope
