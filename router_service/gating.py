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

Expert load (`ExpertLoadStats`) and the Switch Transformer balance term ``N * sum_i f_i * P_i``:
f_i is the fraction of the T * k routes sent to expert i, P_i its mean router probability, so the
term is 1.0 for an even router whatever k is. This equals DeepSpeed's ``topkgating`` l_aux;
transformers' ``load_balancing_loss_func`` counts f_i per top-k slot and is k times larger.

Shapes: T tokens, E experts (= N), K = top_k, G = n_group, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor

if TYPE_CHECKING:
    from router_service.capacity import Routed

GateStyle = Literal["mixtral", "softmax_topk", "sigmoid_bias"]


@dataclass(frozen=True)
class GateConfig:
    """How one MoE layer turns router logits into gates. ``n_group`` / ``topk_group``: DeepSeek-V3's
    group-limited routing (``sigmoid_bias`` only): experts come only from the ``topk_group`` best of
    ``n_group`` equal groups, each scored by the sum of its two best biased scores."""

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
    """``cfg.top_k`` experts per token and their combine weights. router_logits: [..., E] (leading
    dims flattened to T); bias: [E] selection bias, ``sigmoid_bias`` only (None: zeros)."""
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


def switch_balance_loss(probs: Tensor, expert_ids: Tensor, num_experts: int) -> Tensor:
    """``N * sum_i f_i * P_i`` (times alpha is the caller's); differentiable through probs [T, E] only.
    expert_ids: [T, K]; ids < 0 are not counted but stay in the T * K denominator."""
    if probs.dim() != 2 or probs.shape[1] != num_experts:
        raise ValueError(f"probs: expected [T, {num_experts}], got shape {tuple(probs.shape)}")
    ids = expert_ids.reshape(-1)  # [T * K]
    valid = ids >= 0
    counts = torch.bincount(ids[valid], minlength=num_experts).to(probs.dtype)  # [E]
    f = counts / max(ids.numel(), 1)  # [E]
    p = probs.mean(dim=0)  # [E]
    return num_experts * (f * p).sum()


class ExpertLoadStats:
    """Per-layer expert-load counters, cheap to update every step and to ship between processes.
    route_counts:  [L, E] routes the router chose per expert (demand; f_i)
    expert_load:   [L, E] routes the experts actually processed after capacity (reroutes included)
    prob_sums:     [L, E] sum of router probabilities over tokens (P_i = prob_sums / tokens)
    tokens, routes, dropped, rerouted: [L] counts
    """

    _FIELDS = ("route_counts", "expert_load", "prob_sums", "tokens", "routes", "dropped", "rerouted")

    def __init__(self, num_layers: int, num_experts: int) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"num_layers/num_experts: must be >= 1, got {num_layers}/{num_experts}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.route_counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.expert_load = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.prob_sums = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.tokens = torch.zeros(num_layers, dtype=torch.int64)
        self.routes = torch.zeros(num_layers, dtype=torch.int64)
        self.dropped = torch.zeros(num_layers, dtype=torch.int64)
        self.rerouted = torch.zeros(num_layers, dtype=torch.int64)

    def update(self, layer: int, gates: Gates, routed: Routed | None = None) -> None:
        """Add one step of ``layer``; ``routed=None`` means no capacity limit (everything kept)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: must be in 0..{self.num_layers - 1}, got {layer}")
        if gates.num_experts != self.num_experts:
            raise ValueError(f"gates: {gates.num_experts} experts, stats track {self.num_experts}")
        self._to(gates.expert_ids.device)  # accumulate where the gates live: no device sync per step
        ids = gates.expert_ids.reshape(-1)  # [T * K]
        # [E]; not bincount, which on a GPU reads the ids' max on the host
        demand = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
        self.route_counts[layer] += demand
        self.prob_sums[layer] += gates.probs.detach().double().sum(dim=0)
        self.tokens[layer] += gates.num_tokens
        self.routes[layer] += gates.expert_ids.numel()
        if routed is None:
            self.expert_load[layer] += demand
            return
        served = routed.expert_ids.reshape(-1)  # [T * K]
        self.expert_load[layer] += torch.bincount(served[served >= 0], minlength=self.num_experts)
        self.dropped[layer] += routed.num_dropped
        self.rerouted[layer] += routed.num_rerouted

    def merge(self, other: ExpertLoadStats) -> None:
        """Add another collector's counts (e.g. from another shard) into this one."""
        if (other.num_layers, other.num_experts) != (self.num_layers, self.num_experts):
            raise ValueError(f"other: shape {(other.num_layers, other.num_experts)} != "
                             f"{(self.num_layers, self.num_experts)}")
        for name in self._FIELDS:
            getattr(self, name).add_(getattr(other, name).to(getattr(self, name).device))

    def _to(self, device: torch.device) -> None:
        if self.route_counts.device != device:
            for name in self._FIELDS:
                setattr(self, name, getattr(self, name).to(device))

    def to_dict(self) -> dict[str, Any]:
        """Plain python (ints, floats, lists), safe to pickle or JSON-encode across processes."""
        out: dict[str, Any] = {"num_layers": self.num_layers, "num_experts": self.num_experts}
        out.update({name: getattr(self, name).tolist() for name in self._FIELDS})
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExpertLoadStats:
        stats = cls(int(data["num_layers"]), int(data["num_experts"]))
        for name in cls._FIELDS:
            current = getattr(stats, name)
            value = torch.tensor(data[name], dtype=current.dtype)
            if value.shape != current.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(current.shape)}")
            setattr(stats, name, value)
        return stats

    def summary(self) -> list[dict[str, Any]]:
        """Per layer: f_i, P_i, ``balance`` (the Switch term), ``imbalance`` (max/mean of the load
        served; both 1.0 when even, None with no tokens) and overflow counts."""
        layers = []
        for layer in range(self.num_layers):
            tokens, routes = int(self.tokens[layer]), int(self.routes[layer])
            load = self.expert_load[layer].double().cpu()  # [E]
            if tokens == 0:
                f = p = [0.0] * self.num_experts
                balance = imbalance = None
            else:
                f_t = self.route_counts[layer].double().cpu() / routes  # [E]
                p_t = self.prob_sums[layer].cpu() / tokens  # [E]
                balance = float(self.num_experts * (f_t * p_t).sum())
                mean = float(load.mean())
                imbalance = float(load.max()) / mean if mean > 0 else None
                f, p = f_t.tolist(), p_t.tolist()
            layers.append({"layer": layer, "tokens": tokens, "routes": routes, "f": f, "P": p, "balance": balance,
                           "imbalance": imbalance, "dropped": int(self.dropped[layer]),
                           "rerouted": int(self.rerouted[layer])})
        return layers
