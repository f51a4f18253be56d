"""The experts a process holds: SwiGLU FFNs stored fused, as transformers 5.x does.

Shapes: R routes (token copies) sorted by expert, El local experts, D hidden, I expert width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class LocalExperts(nn.Module):
    """A subset of a layer's experts. `expert_ids[j]` is the global id of local expert j."""

    def __init__(self, expert_ids: Sequence[int], hidden: int, intermediate: int) -> None:
        super().__init__()
        self.expert_ids = tuple(int(e) for e in expert_ids)
        n = len(self.expert_ids)
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * intermediate, hidden))  # [El, 2I, D]
        self.down_proj = nn.Parameter(torch.empty(n, hidden, intermediate))  # [El, D, I]

    @property
    def num_local(self) -> int:
        return len(self.expert_ids)

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """x: [R, D] routes grouped by local expert, `counts[j]` rows for local expert j. Returns [R, D]."""
        outs = []
        for j, chunk in enumerate(torch.split(x, list(counts))):
            if chunk.shape[0] == 0:
                outs.append(chunk)
                continue
            gate, up = F.linear(chunk, self.gate_up_proj[j]).chunk(2, dim=-1)  # [Rj, I] x2
            outs.append(F.linear(F.silu(gate) * up, self.down_proj[j]))  # [Rj, D]
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])
