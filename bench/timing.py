"""Interleaved timing, and the one way every bench reports a ratio.

Every case runs once per round, in a rotating order, so that load from other processes on a
shared machine hits all cases alike. A ratio between two cases is taken per round (side by
side) and reported as the median of those per-round ratios with a bootstrap interval over the
rounds (`Ratio`, `ratio_over_rounds`, `format_ratio`). The ratio of two median rates is not
used: it pairs numbers from different rounds, so one slow round on either side moves it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm import tqdm

LEVEL = 0.9  # the interval every report gives: a 90% percentile bootstrap


@dataclass(frozen=True)
class Run:
    """One timed run of a case: tokens generated, wall seconds, and what the case reported."""

    tokens: int
    seconds: float
    extra: dict

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.seconds <= 0:
            raise ValueError(f"need tokens >= 0 and seconds > 0, got {self.tokens}, {self.seconds}")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Ratio:
    """A ratio measured over rounds: the median of the per-round ratios, and the `level`
    bootstrap interval [low, high] of that median (the rounds resampled with replacement).
    The interval says how far the median could be from what the machine's noise lets this
    many rounds say: a ratio whose interval lies wholly below a bar is measurably below it."""

    median: float
    low: float
    high: float
    rounds: int
    level: float = LEVEL

    def __str__(self) -> str:
        return format_ratio(self)

    def as_dict(self) -> dict[str, float | int]:
        """The JSON form (bench.report.write uses it for any Ratio in a report's data)."""
        return {"median": self.median, "low": self.low, "high": self.high, "rounds": self.rounds, "level": self.level}


def ratio_over_rounds(a: Sequence[float], b: Sequence[float], level: float = LEVEL, resamples: int = 2000,
                      seed: int = 0) -> Ratio:
    """a[i] / b[i] per round i, as a `Ratio`: their median and its percentile bootstrap interval.
    Seeded, so the same rounds always give the same interval."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if len(a) != len(b):
        raise ValueError(f"need one value per round on both sides, got {len(a)} and {len(b)} rounds")
    if not a:
        raise ValueError("need at least one round")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return Ratio(statistics.median(ratios), medians[int(tail * (resamples - 1))],
                 medians[int((1.0 - tail) * (resamples - 1))], len(ratios), level)


def format_ratio(r: Ratio, digits: int = 2) -> str:
    """'3.40x [3.10, 3.70]': the median of per-round ratios and its interval (the one format of
    every report's ratios)."""
    if r.rounds < 2:
        return f"{r.median:.{digits}f}x [1 round: no interval]"
    return f"{r.median:.{digits}f}x [{r.low:.{digits}f}, {r.high:.{digits}f}]"


# A case runs its workload and returns (tokens generated, extra facts such as spec metrics).
Case = Callable[[], tuple[int, dict]]


def interleaved(cases: dict[str, Case], rounds: int, warmup: bool = True, desc: str = "") -> dict[str, list[Run]]:
    """Runs every case `rounds` times, rotating the order each round; one untimed warm-up each."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(cases)
    if warmup:
        for name in names:
            cases[name]()
    runs: dict[str, list[Run]] = {name: [] for name in names}
    with tqdm(total=rounds * len(names), desc=desc or "runs", leave=False) as bar:
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                tokens, extra = cases[name]()
                runs[name].append(Run(tokens, time.perf_counter() - t0, extra))
                bar.update()
    return runs


def paired(runs: dict[str, list[Run]], a: str, b: str, level: float = LEVEL) -> Ratio:
    """tokens/s(a) / tokens/s(b) over the interleaved rounds, each round's pair measured side by side."""
    return ratio_over_rounds([r.tokens_per_s for r in runs[a]], [r.tokens_per_s for r in runs[b]], level)


def summarize(runs: dict[str, list[Run]], baseline: str | None = None) -> dict[str, dict]:
    """Median tokens/s per case (with min and max) and, against `baseline`, the `Ratio` of the
    case to it ("ratio")."""
    out = {}
    for name, rs in runs.items():
        tps = [r.tokens_per_s for r in rs]
        row = {"tokens": rs[0].tokens, "median_tokens_per_s": statistics.median(tps), "min_tokens_per_s": min(tps),
               "max_tokens_per_s": max(tps), "runs": len(rs)}
        if baseline is not None and name != baseline:
            row["ratio"] = paired(runs, name, baseline)
        out[name] = row
    return out
