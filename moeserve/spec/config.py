"""The engine's speculative-decoding settings (built from the config tree's `speculative` section)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: `num_tokens` draft tokens per step (the cap when adaptive).

    adaptive: choose k per sequence (AdaptiveK) from its acceptance rate and the step
        costs the engine measures; the cost model is refit every `refit_every` decode steps.
    disable_by_batch_size: decode without speculation while this many sequences or more are
        running (0: never). A big batch already keeps the model busy, and verifying k + 1
        positions per row then costs nearly k + 1 times a plain step.
    """

    num_tokens: int = 4
    adaptive: bool = False
    refit_every: int = 16
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_tokens <= 16:
            raise ValueError(f"num_tokens: must be in [0, 16], got {self.num_tokens}")
        if self.refit_every < 1:
            raise ValueError(f"refit_every: must be >= 1, got {self.refit_every}")
        if self.disable_by_batch_size < 0:
            raise ValueError(f"disable_by_batch_size: must be >= 0, got {self.disable_by_batch_size}")
