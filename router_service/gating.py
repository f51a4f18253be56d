"""Top-k gating: router logits -> per-token expert ids and combine weights.

Each style reproduces a Hugging Face transformers router (5.x) operation for operation, so a
model built on it matches transformers' logits:

- ``mixtral``       MixtralTopKRouter: softmax over all experts in fp32, top-k, divide by the
                    top-k sum (== softmax over the k kept logits). Weights stay fp32.
- ``softmax_topk``  Qwen2-MoE / Qwen3-MoE / OLMoE: softmax over all experts in fp32, top-k,
                    renormalise only if ``norm_topk_prob``; weights cast back to the logits dtype.
- ``sigmoid_bias``  DeepSeek-V3: sigmoid scores; a per-expert bias (``e_score_correction_bias``)
                    shifts the scores only for *choosing* experts (optionally within the best
                    ``topk_group`` of ``n_group`` groups); the weights are the unbiased scores,
                    normalised if ``norm_topk_prob``, times ``routed_scaling_factor``. fp32.

Shapes: T tokens, E experts, K = top_k, G = n_group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

GateStyle = Literal["mixtral", "softmax_topk", "sigmoid_bias"]


@dataclass(frozen=True)
class GateConfig:
    """How one MoE layer turns router logits into gates.

    ``n_group`` / ``topk_group`` are DeepSeek-V3's group-limited routing (``sigmoid_bias`` only):
    experts are split into ``n_group`` equal groups, each group is scored by the sum of its two
    best biased scores, and experts are chosen only from the best ``topk_group`` groups.
    """

    num_experts: int
    top_k: int
    style: GateStyle = "mixtral"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        if self.style not in get_args(GateStyle):
            raise ValueError(f"style: {self.style!r} is not one of {get_args(GateStyle)}")
        if self.num_experts < 1:
            raise ValueError(f"num_experts: must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k: must be in 1..num_experts={self.num_experts}, got {self.top_k}")
        if self.style == "mixtral" and not self.norm_topk_prob:
            raise ValueError("norm_topk_prob: Mixtral always renormalises over the top-k; use style='softmax_topk'")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor: must be > 0, got {self.routed_scaling_factor}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group: must be >= 1 and divide num_experts={self.num_experts}, got {self.n_group}")
        if self.n_group > 1:
            if self.style != "sigmoid_bias":
                raise ValueError("n_group: group-limited routing exists only for style='sigmoid_bias'")
            if self.num_experts // self.n_group < 2:
                raise ValueError("n_group: each group needs >= 2 experts (groups are scored by their top-2 sum)")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group: must be in 1..n_group={self.n_group}, got {self.topk_group}")
            if self.top_k > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError("top_k: larger than the number of experts in the topk_group chosen groups")


@dataclass
class Gates:
    """The router's decision for a batch of tokens.

    weights:    [T, K] combine weight of each chosen expert (fp32, or the logits dtype for softmax_topk)
    expert_ids: [T, K] int64 chosen experts, sorted by descending (for sigmoid_bias: biased) score
    probs:      [T, E] fp32 full router probabilities (softmax over all experts, or the sigmoid
                scores for sigmoid_bias); used for statistics, capacity priority and rerouting
    """

    weights: Tensor
    expert_ids: Tensor
    probs: Tensor

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]


def topk_gate(router_logits: Tensor, cfg: GateConfig, bias: Tensor | None = None) -> Gates:
    """Choose ``cfg.top_k`` experts per token and their combine weights.

    router_logits: [..., E] (leading dims are flattened to T, as the transformers routers do).
    bias: [E] per-expert selection bias, only for ``sigmoid_bias`` (None means zeros).
    """
    if router_logits.shape[-1] != cfg.num_experts:
        raise ValueError(f"router_logits: last dim {router_logits.shape[-1]} != num_experts {cfg.num_experts}")
    if bias is not None and cfg.style != "sigmoid_bias":
        raise ValueError(f"bias: only style='sigmoid_bias' uses a selection bias, not {cfg.style!r}")
    if bias is not None and tuple(bias.shape) != (cfg.num_experts,):
        raise ValueError(f"bias: expected shape ({cfg.num_experts},), got {tuple(bias.shape)}")
    logits = router_logits.reshape(-1, cfg.num_experts)  # [T, E]
    if cfg.style == "sigmoid_bias":
        return _sigmoid_bias_gate(logits, cfg, bias)

    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    top, expert_ids = torch.topk(probs, cfg.top_k, dim=-1)  # [T, K]
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)  # [T, K]
    if cfg.routed_scaling_factor != 1.0:
        top = top * cfg.routed_scaling_factor
    if cfg.style == "softmax_topk":
        # Qwen/OLMoE hand the experts weights in the activation dtype; Mixtral keeps fp32.
        top = top.to(logits.dtype)
    return Gates(weights=top, expert_ids=expert_ids, probs=probs)


def _sigmoid_bias_gate(logits: Tensor, cfg: GateConfig, bias: Tensor | None) -> Gates:
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores if bias is None else scores + bias.float()  # [T, E]
    if cfg.n_group > 1:
        per_group = cfg.num_experts // cfg.n_group
        grouped = choice.view(-1, cfg.n_group, per_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)  # [T, G]
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(-1, cfg.num_experts)  # [T, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    expert_ids = torch.topk(choice, cfg.top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, expert_ids)  # [T, K]
    if cfg.norm_topk_prob:
        # DeepSeek adds 1e-20 so an all-underflow row does not divide by zero.
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    return Gates(weights=weights, expert_ids=expert_ids, probs=scores)
