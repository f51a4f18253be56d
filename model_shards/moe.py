"""The sparse MoE block: gate -> capacity -> dispatch -> local experts -> combine (+ shared expert).

Shapes: N tokens (flattened batch), D hidden, E experts, El local experts, K experts per token,
I expert width, R kept routes (token copies) sorted by expert.

Every `Dispatch` returns per-route outputs in the caller's [N, K] order and `combine` is shared,
so the reference (`LocalDispatch`) and the all-to-all add the same numbers in the same order.

`LocalExperts` are SwiGLU FFNs stored fused (as transformers 5.x), run as one grouped matmul per
projection where torch has one for the device and dtype (on the CPU only up to
GROUPED_MAX_ROUTES_CPU routes). In a compiled graph a block holding every expert runs `fused`
instead (no data-dependent sizes; exact for capacity "none"). `phase()` times named phases of a
pass for benchmarks; disabled (the default), it costs nothing.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.config import ModelConfig
from model_shards.layers import MLP, Direct, Linear
from moeserve.config import RoutingSection
from router_service.capacity import apply_capacity, expert_capacity
from router_service.gating import ExpertLoadStats, GateConfig, Gates, topk_gate

_UNTIMED = nullcontext()  # reusable: entering it does nothing


class PhaseTimer:
    def __init__(self) -> None:
        self.enabled = False
        self.totals: dict[str, float] = defaultdict(float)

    def phase(self, name: str) -> AbstractContextManager[None]:
        if torch.compiler.is_compiling() or not self.enabled:  # inside a graph: one op stream, no phases
            return _UNTIMED
        return self._timed(name)

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t0

    def reset(self) -> None:
        self.totals.clear()


TIMER = PhaseTimer()
phase = TIMER.phase


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
    """Whether torch's fused bf16 grouped GEMM runs here (CUDA, capability 9.x/10.x; elsewhere it
    loops over the groups on the host)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] in (9, 10)


class LocalExperts(Direct, nn.Module):
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
        """x: [P, D] grouped by local expert, expert j's rows ending at `ends[j]` ([El] int32 on x's
        device), then padding. Returns [P, D]; no host sync where the grouped matmul runs."""
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


def combine(route_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """route_out: [N, K, D] (zeros for dropped routes), weights: [N, K] -> [N, D]."""
    return (route_out * weights[..., None].to(route_out.dtype)).sum(dim=1)


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Flattened kept routes ordered by expert: (route index [R], expert of each [R], count per expert [E])."""
    flat = expert_ids.reshape(-1)  # [N*K]
    kept = torch.nonzero(flat >= 0).squeeze(1)  # [R]
    order = kept[torch.argsort(flat[kept], stable=True)]  # [R]
    counts = torch.bincount(flat[order], minlength=num_experts)  # [E]
    return order, flat[order], counts.tolist()


class Dispatch(ABC):
    """Sends each kept route of each token to the expert that owns it and returns the expert outputs."""

    @abstractmethod
    def route(self, x: torch.Tensor, expert_ids: torch.Tensor, experts: LocalExperts) -> torch.Tensor:
        """x: [N, D]; expert_ids: [N, K] global ids, -1 for a dropped route. Returns [N, K, D]."""

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 experts: LocalExperts) -> torch.Tensor:
        route_out = self.route(x, expert_ids, experts)
        with phase("combine"):
            return combine(route_out, weights)


class LocalDispatch(Dispatch):
    """All experts live in this process (world size 1): the reference every other dispatch must match."""

    def route(self, x: torch.Tensor, expert_ids: torch.Tensor, experts: LocalExperts) -> torch.Tensor:
        n, k = expert_ids.shape
        if experts.expert_ids != tuple(range(experts.num_local)):
            raise ValueError("LocalDispatch needs every expert of the layer in this process")
        with phase("dispatch"):
            order, _, counts = group_by_expert(expert_ids, experts.num_local)
            routed = x[order // k]  # [R, D]
        with phase("experts"):
            y = experts(routed, counts)  # [R, D]
        with phase("combine"):
            out = x.new_zeros(n * k, x.shape[-1])  # [N*K, D]
            out[order] = y
        return out.view(n, k, x.shape[-1])


# Experts up to this size a layer (they stay in cache) run routed at any batch; larger ones only while N*K <= E.
ROUTED_MAX_EXPERT_BYTES = 16 << 20


class MoEBlock(Direct, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, local_experts: Sequence[int]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_cfg = GateConfig(cfg.num_experts, cfg.top_k, style=cfg.gate_style, norm_topk_prob=cfg.norm_topk_prob,
                                   routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
                                   topk_group=cfg.topk_group)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        if cfg.gate_style == "sigmoid_bias":  # the checkpoint's `gate.e_score_correction_bias`: for choosing only
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.experts = LocalExperts(local_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:  # DeepSeek's `shared_experts` load here (model_shards/loader.py)
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            gated = cfg.shared_expert_gated
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if gated else None
        # Set by the owning model; plain attributes, not submodules or parameters.
        self.dispatch: Dispatch = LocalDispatch()
        self.routing = RoutingSection()
        self.stats: ExpertLoadStats | None = None
        self.trace: list | None = None  # while routing is recorded: (expert_ids, weights) [N, K] per forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D]."""
        with phase("gating"):
            gates = self.gates(x)
        return self.after_gating(x, gates, None if self.shared_expert is None else self.shared_out(x))

    def gates(self, x: torch.Tensor) -> Gates:
        """The router's choice for x [N, D]: weights, expert_ids [N, K]; probs [N, E]."""
        return topk_gate(self.gate(x), self.gate_cfg, getattr(self.gate, "e_score_correction_bias", None))

    def shared_out(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output for x [N, D], gated where the model gates it (only where it has one)."""
        out = self.shared_expert(x)
        return out if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * out

    def after_gating(self, x: torch.Tensor, gates: Gates, shared: torch.Tensor | None) -> torch.Tensor:
        """After the router, for x [N, D]: capacity, statistics, tracing, dispatch, combine, + `shared`."""
        with phase("gating"):
            routed = None
            expert_ids, weights = gates.expert_ids, gates.weights
            if self.routing.overflow != "none":
                cap = expert_capacity(x.shape[0], self.gate_cfg.num_experts, self.gate_cfg.top_k,
                                      self.routing.capacity_factor, self.routing.min_capacity)
                routed = apply_capacity(gates, cap, self.routing.overflow)
                expert_ids, weights = routed.expert_ids, routed.weights
            if self.stats is not None:
                self.stats.update(self.layer_idx, gates, routed)
            if self.trace is not None:
                self.trace.append((self.layer_idx, expert_ids, weights))
        out = self.dispatch(x, expert_ids, weights, self.experts)  # [N, D]
        return out if shared is None else out + shared

    def fused(self, x: torch.Tensor) -> tuple[torch.Tensor, Gates]:
        """x [N, D] -> ([N, D], gates) with no data-dependent shapes (every expert local, no capacity):
        routed when N * K <= E or the experts are small, else dense. Statistics are the caller's."""
        g = self.gates(x)  # weights, expert_ids [N, K]; probs [N, E]
        n, k = g.expert_ids.shape
        # the size test first: testing the symbolic N guards the graph, which small experts never need
        if self.small_experts() or n * k <= self.experts.num_local:
            out = _routed(self.experts, x, g)
        else:
            out = _dense(self.experts, x, g)
        return (out if self.shared_expert is None else out + self.shared_out(x)), g

    def small_experts(self) -> bool:
        e = self.experts
        return (e.gate_up_proj.numel() + e.down_proj.numel()) * e.gate_up_proj.element_size() <= ROUTED_MAX_EXPERT_BYTES


def _routed(e: LocalExperts, x: torch.Tensor, g: Gates) -> torch.Tensor:
    """[N, D]: each token through its top-k experts (each route reads its expert's weights)."""
    gate, up = (e.gate_up_proj[g.expert_ids] * x[:, None, None, :]).sum(-1).chunk(2, dim=-1)  # [N, K, I] x2
    y = (e.down_proj[g.expert_ids] * (F.silu(gate) * up)[:, :, None, :]).sum(-1)  # [N, K, D]
    return (g.weights.to(x.dtype)[..., None] * y).sum(1)  # [N, D]


def _dense(e: LocalExperts, x: torch.Tensor, g: Gates) -> torch.Tensor:
    """[N, D]: every token through every expert, weighted by its gates: E / K times the arithmetic,
    but each expert's weights read once."""
    n, d = x.shape
    w = x.new_zeros(n, e.num_local).scatter(1, g.expert_ids, g.weights.to(x.dtype))  # [N, E]
    gate, up = F.linear(x, e.gate_up_proj.view(-1, d)).view(n, e.num_local, -1).chunk(2, dim=-1)  # [N, E, I] x2
    y = torch.bmm((F.silu(gate) * up).transpose(0, 1), e.down_proj.transpose(1, 2))  # [E, N, D]
    return torch.einsum("ne,end->nd", w, y)  # [N, D]
