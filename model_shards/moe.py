"""The sparse MoE block: gate -> capacity -> dispatch -> local experts -> combine (+ shared expert).

Shapes: N tokens (flattened batch), D hidden, E experts, K experts per token, I expert width.
The gating math lives in router_service/; how routes reach experts is the `Dispatch`.

Inside a compiled graph (model_shards/compiled_step.py), where the dispatch's data-dependent
split sizes cannot go, a block holding every expert runs `fused` instead: each token through its
top-k experts as gather-multiply-sums that inductor fuses into one reduction per projection
loading the routed experts' weights by index, or, where that would read more expert weights
than there are and they do not fit the CPU's caches, every expert as one dense matmul weighted
by the gates. Both are exact for capacity "none".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.config import ModelConfig
from model_shards.dispatch import Dispatch, LocalDispatch
from model_shards.experts import LocalExperts
from model_shards.layers import MLP
from model_shards.profiling import phase
from moeserve.config import RoutingSection
from router_service.capacity import apply_capacity, expert_capacity
from router_service.gating import GateConfig, Gates, topk_gate
from router_service.stats import ExpertLoadStats

# A layer's experts up to this size are read routed at any batch (they stay in the CPU's caches:
# demo MoE, 3 MiB); larger ones (Mixtral-8x7B: 2.8 GB a layer) only while N * K <= E.
ROUTED_MAX_EXPERT_BYTES = 16 << 20


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, local_experts: Sequence[int]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_cfg = GateConfig(
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            style=cfg.gate_style,
            norm_topk_prob=cfg.norm_topk_prob,
        )
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = LocalExperts(local_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
        # Set by the owning model; plain attributes, not submodules or parameters.
        self.dispatch: Dispatch = LocalDispatch()
        self.routing = RoutingSection()
        self.stats: ExpertLoadStats | None = None
        self.trace: list | None = None  # while routing is recorded: (expert_ids, weights) [N, K] per forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D]."""
        with phase("gating"):
            gates = topk_gate(self.gate(x), self.gate_cfg)  # weights, expert_ids [N, K]; probs [N, E]
        return self.after_gating(x, gates, None if self.shared_expert is None else self.shared_out(x))

    def shared_out(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's gated output for x [N, D] (only where the model has one)."""
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def after_gating(self, x: torch.Tensor, gates: Gates, shared: torch.Tensor | None) -> torch.Tensor:
        """Everything after the router, for x [N, D] and its gates: capacity, load statistics,
        recorded routing, dispatch and combine, plus the shared expert's output. (A compiled
        expert-parallel pass gates in its graph and calls this eagerly: model_shards/compiled_step.py.)"""
        with phase("gating"):
            routed = None
            expert_ids, weights = gates.expert_ids, gates.weights
            if self.routing.overflow != "none":
                cap = expert_capacity(
                    x.shape[0], self.gate_cfg.num_experts, self.gate_cfg.top_k,
                    self.routing.capacity_factor, self.routing.min_capacity,
                )
                routed = apply_capacity(gates, cap, self.routing.overflow)
                expert_ids, weights = routed.expert_ids, routed.weights
            if self.stats is not None:
                self.stats.update(self.layer_idx, gates, routed)
            if self.trace is not None:
                self.trace.append((self.layer_idx, expert_ids, weights))
        out = self.dispatch(x, expert_ids, weights, self.experts)  # [N, D]
        return out if shared is None else out + shared

    def fused(self, x: torch.Tensor) -> tuple[torch.Tensor, Gates]:
        """x [N, D] -> ([N, D], the gates) with every expert local and no capacity limit, without
        data-dependent shapes: routed when that reads no more expert weights than running every
        token through every expert (N * K <= E), or when a layer's experts are small enough to
        stay in the caches (ROUTED_MAX_EXPERT_BYTES); else dense. Statistics are the caller's."""
        g = topk_gate(self.gate(x), self.gate_cfg)  # weights, expert_ids [N, K]; probs [N, E]
        n, k = g.expert_ids.shape
        # the size test first: N is symbolic, so testing it puts a guard on the graph (a recompile
        # when a batch crosses E / K tokens), which small experts never need
        if self.small_experts() or n * k <= self.experts.num_local:
            out = _routed(self.experts, x, g)
        else:
            out = _dense(self.experts, x, g)
        return (out if self.shared_expert is None else out + self.shared_out(x)), g

    def small_experts(self) -> bool:
        e = self.experts
        return (e.gate_up_proj.numel() + e.down_proj.numel()) * e.gate_up_proj.element_size() <= ROUTED_MAX_EXPERT_BYTES


def _routed(e: LocalExperts, x: torch.Tensor, g: Gates) -> torch.Tensor:
    """[N, D]: each token through its top-k experts. A route reads its expert's weights: from the
    caches when they fit there (a token reads its K experts' weights, where dense reads all E),
    from memory once per route otherwise."""
    gate, up = (e.gate_up_proj[g.expert_ids] * x[:, None, None, :]).sum(-1).chunk(2, dim=-1)  # [N, K, I] x2
    y = (e.down_proj[g.expert_ids] * (F.silu(gate) * up)[:, :, None, :]).sum(-1)  # [N, K, D]
    return (g.weights.to(x.dtype)[..., None] * y).sum(1)  # [N, D]


def _dense(e: LocalExperts, x: torch.Tensor, g: Gates) -> torch.Tensor:
    """[N, D]: every token through every local expert, combined by the top-k gate weights (zero
    elsewhere): E / K times the arithmetic, but each expert's weights read once, by one matmul
    against the stacked weights (a view, no copy) and one batched one."""
    n, d = x.shape
    w = x.new_zeros(n, e.num_local).scatter(1, g.expert_ids, g.weights.to(x.dtype))  # [N, E]
    gate, up = F.linear(x, e.gate_up_proj.view(-1, d)).view(n, e.num_local, -1).chunk(2, dim=-1)  # [N, E, I] x2
    y = torch.bmm((F.silu(gate) * up).transpose(0, 1), e.down_proj.transpose(1, 2))  # [E, N, D]
    return torch.einsum("ne,end->nd", w, y)  # [N, D]
