"""Speculative-decoding metrics, with the formula's prediction next to what was measured.

Shapes: B sequences verified in one target pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from torch import Tensor

_DERIVED = ("acceptance_rate", "alpha", "mean_k", "mean_accepted_length", "tokens_per_pass",
            "predicted_tokens_per_pass", "draft_time_share")


def expected_tokens_per_pass(alpha: float, k: float) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens one target pass emits with k drafts (the
    accepted prefix is geometric, plus one recovered or bonus token); k may be a mean."""
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"need alpha in [0, 1] and k >= 0, got {alpha}, {k}")
    if alpha > 1.0 - 1e-9:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


def _as_list(values: Tensor | Sequence[int]) -> list[int]:
    return values.tolist() if isinstance(values, Tensor) else [int(v) for v in values]


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


@dataclass
class SpecMetrics:
    """Running totals over verification steps. A step is one batched target pass; a sequence pass
    is one row of it, and rates per pass are per sequence pass, as the formula predicts them."""

    num_steps: int = 0
    num_seq_passes: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0
    num_emitted_tokens: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0

    def record(self, num_draft: Tensor | Sequence[int], num_accepted: Tensor | Sequence[int], draft_time_s: float = 0.0,
               target_time_s: float = 0.0, num_emitted: Tensor | Sequence[int] | None = None) -> None:
        """Adds one target pass over B rows: num_draft, num_accepted [B]; num_emitted [B], the
        tokens streamed when fewer than accepted + 1 (a stop token or max_tokens cut the step)."""
        drafted, accepted = _as_list(num_draft), _as_list(num_accepted)
        if len(drafted) != len(accepted) or any(not 0 <= a <= d for d, a in zip(drafted, accepted)):
            raise ValueError(f"need 0 <= num_accepted <= num_draft per row, got {drafted}, {accepted}")
        if draft_time_s < 0 or target_time_s < 0:
            raise ValueError("times must be >= 0")
        self.num_steps += 1
        self.num_seq_passes += len(drafted)
        self.num_draft_tokens += sum(drafted)
        self.num_accepted_tokens += sum(accepted)
        self.num_rejections += sum(1 for d, a in zip(drafted, accepted) if a < d)
        self.num_emitted_tokens += sum(a + 1 for a in accepted) if num_emitted is None else sum(_as_list(num_emitted))
        self.draft_time_s += draft_time_s
        self.target_time_s += target_time_s

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (vLLM's); below alpha, as drafts after a rejection count."""
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def alpha(self) -> float:
        """The formula's per-token acceptance: accepted / (accepted + first rejections)."""
        return _ratio(self.num_accepted_tokens, self.num_accepted_tokens + self.num_rejections)

    @property
    def mean_k(self) -> float:
        return _ratio(self.num_draft_tokens, self.num_seq_passes)

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per sequence pass (vLLM's mean acceptance length is this + 1)."""
        return _ratio(self.num_accepted_tokens, self.num_seq_passes)

    @property
    def tokens_per_pass(self) -> float:
        return _ratio(self.num_emitted_tokens, self.num_seq_passes)

    @property
    def predicted_tokens_per_pass(self) -> float:
        """(1 - alpha^(k+1)) / (1 - alpha) at the measured alpha and mean k."""
        return expected_tokens_per_pass(self.alpha, self.mean_k) if self.num_seq_passes else 0.0

    @property
    def draft_time_share(self) -> float:
        return _ratio(self.draft_time_s, self.draft_time_s + self.target_time_s)

    def to_dict(self) -> dict[str, float]:
        """Counters and derived rates, flat, for /metrics and bench reports."""
        return dict(asdict(self)) | {name: getattr(self, name) for name in _DERIVED}
