"""Wall-clock split of a forward pass into named phases (attention, gating, dispatch, experts,
combine), for benchmarks. Off by default: a disabled `phase()` is one attribute check."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self) -> None:
        self.enabled = False
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t0

    def reset(self) -> None:
        self.totals.clear()


TIMER = PhaseTimer()
phase = TIMER.phase
