"""The experts a process holds: SwiGLU FFNs stored fused, as transformers 5.x does.

Shapes: R routes (token copies) sorted by expert, El local experts, D hidden, I expert width.

A layer's experts run as one grouped matmul per projection (`torch._grouped_mm`: one kernel
for every expert's rows, given where each expert's rows end) wherever torch has it for the
tensors' device and dtype: CUDA bf16 where torch has its fused kernel (`cuda_grouped_kernel`),
and the CPU. On
the CPU it pays for decode-sized batches and not for prefill: one kernel saves a dispatch per
expert, which counts when each expert has few rows; on prefill-sized groups a plain matmul per
expert is the faster kernel (the crossover, measured on the demo's expert shape with one
thread, is GROUPED_MAX_ROUTES_CPU). So CPU batches past that many routes take the per-expert
loop; GPUs without grouped mm take one batched matmul over groups padded to the largest.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

GROUPED_MAX_ROUTES_CPU = 256


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes [R, D] @ w [El, D, N] for x's device and dtype."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    aligned = all(s * x.element_size() % 16 == 0 for s in w.shape[-2:])  # every row stride: 16 bytes
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and aligned and cuda_grouped_kernel(x.device)
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and aligned


def cuda_grouped_kernel(device: torch.device) -> bool:
    """Whether torch's fused bf16 grouped GEMM (CUTLASS, offsets read on the device) runs on this
    GPU: torch takes it on CUDA (not ROCm) builds for compute capability 9.x and 10.x only (H100,
    H200, B200); on any other GPU `torch._grouped_mm` copies the offsets to the host and loops
    over the groups, which is no better than `_padded` and syncs."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] in (9, 10)


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
        counts = list(counts)
        if x.shape[0] == 0:
            return x.new_zeros(0, x.shape[-1])
        gate_up, down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)  # [El, D, 2I], [El, I, D]
        small = x.device.type != "cpu" or x.shape[0] <= GROUPED_MAX_ROUTES_CPU
        if small and self._grouped_supported(x):
            return self._grouped(x, torch.tensor(list(accumulate(counts)), dtype=torch.int32, device=x.device))
        if x.device.type == "cpu":
            return self._per_expert(x, counts)
        return self._padded(x, counts, gate_up, down)

    def forward_ends(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x: [P, D] routes grouped by local expert, expert j's rows ending at row `ends[j]` ([El]
        int32 on x's device), padding after the last. Returns [P, D]; padding rows hold anything.
        No host sync wherever the grouped matmul runs; elsewhere the group sizes are read once."""
        if x.shape[0] == 0 or self.num_local == 0:
            return x.new_zeros(x.shape)
        if self._grouped_supported(x):
            return self._grouped(x, ends)
        counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()  # this device has no grouped kernel
        out = x.new_zeros(x.shape)  # [P, D]
        out[: sum(counts)] = self(x[: sum(counts)], counts)
        return out

    def _grouped_supported(self, x: torch.Tensor) -> bool:
        gate_up, down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        return grouped_mm_supported(x, gate_up) and grouped_mm_supported(x, down)  # both projections

    def _grouped(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """One grouped matmul per projection; rows past ends[-1] are left out (their output: anything)."""
        gate_up, down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)  # [El, D, 2I], [El, I, D]
        gate, up = torch._grouped_mm(x, gate_up, offs=ends).chunk(2, dim=-1)  # [R, I] x2
        return torch._grouped_mm(F.silu(gate) * up, down, offs=ends)  # [R, D]

    def _per_expert(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """A matmul per expert with rows (the CPU's fastest for prefill-sized batches)."""
        outs = []
        for j, chunk in enumerate(torch.split(x, counts)):
            if chunk.shape[0] == 0:
                continue
            gate, up = F.linear(chunk, self.gate_up_proj[j]).chunk(2, dim=-1)  # [Rj, I] x2
            outs.append(F.linear(F.silu(gate) * up, self.down_proj[j]))  # [Rj, D]
        return torch.cat(outs)

    def _padded(self, x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """One batched matmul per projection over the groups, each padded to the largest."""
        sizes = torch.tensor(counts, device=x.device)  # [El]
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), sizes)  # [R]
        row = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
        padded = x.new_zeros(len(counts), max(counts), x.shape[-1])  # [El, Cmax, D]
        padded[expert, row] = x
        gate, up = torch.bmm(padded, gate_up).chunk(2, dim=-1)  # [El, Cmax, I] x2
        return torch.bmm(F.silu(gate) * up, down)[expert, row]  # [R, D]
