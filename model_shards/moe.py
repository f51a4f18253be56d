"""The sparse MoE block: gate -> capacity -> dispatch -> local experts -> combine (+ shared expert).

Shapes: N tokens (flattened batch), D hidden, E experts, K experts per token.
The gating math lives in router_service/; how routes reach experts is the `Dispatch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
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
        expert-parallel pass gates in its graph and calls this eagerly: model_shards/compiled_shard.py.)"""
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
