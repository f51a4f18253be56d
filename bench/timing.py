"""Interleaved timing: every case runs once per round, in a rotating order, so that load
from other processes on a shared machine hits all cases alike; ratios are taken per round
(side by side) and then their median is reported."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm


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


def summarize(runs: dict[str, list[Run]], baseline: str | None = None) -> dict[str, dict]:
    """Median tokens/s per case (with min and max) and, against `baseline`, the median of the
    per-round ratios."""
    out = {}
    for name, rs in runs.items():
        tps = [r.tokens_per_s for r in rs]
        row = {"tokens": rs[0].tokens, "median_tokens_per_s": statistics.median(tps), "min_tokens_per_s": min(tps),
               "max_tokens_per_s": max(tps), "runs": len(rs)}
        if baseline is not None and name != baseline:
            row["median_ratio"] = paired_ratio(runs, name, baseline)
            row["ratio_interval"] = ratio_interval(runs, name, baseline)
        out[name] = row
    return out


def ratio_interval(runs: dict[str, list[Run]], a: str, b: str, level: float = 0.9, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval (`level`, percentile) of the median per-round ratio tokens/s(a) /
    tokens/s(b): the rounds resampled with replacement. How far a median could be from what
    the machine's noise lets a run of these rounds say: a case whose interval lies wholly below
    a bar is measurably below it."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    ratios = [x.tokens_per_s / y.tokens_per_s for x, y in zip(runs[a], runs[b])]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1.0 - tail) * (resamples - 1))]


def paired_ratio(runs: dict[str, list[Run]], a: str, b: str) -> float:
    """Median over rounds of tokens/s(a) / tokens/s(b), each round's pair measured side by side."""
    return statistics.median(x.tokens_per_s / y.tokens_per_s for x, y in zip(runs[a], runs[b]))
