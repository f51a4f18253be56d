"""Expert-load statistics and the Switch Transformer balance term.

For N experts, f_i is the fraction of routes the router sends to expert i and P_i the mean
router probability of expert i. With top-k routing f_i counts routes divided by T * k, so
sum_i f_i = 1 and the balance term ``N * sum_i f_i * P_i`` is 1.0 for a perfectly even router
whatever k is (seeds: balanced 1.0, collapsed 2.8, in units of alpha). This equals DeepSpeed's
``topkgating`` l_aux; transformers' ``load_balancing_loss_func`` counts f_i per top-k slot and
is k times larger.

Shapes: T tokens, E experts (= N), K = top_k, L layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from router_service.capacity import Routed
from router_service.gating import Gates


def switch_balance_loss(probs: Tensor, expert_ids: Tensor, num_experts: int) -> Tensor:
    """``N * sum_i f_i * P_i`` (multiply by alpha yourself); differentiable through ``probs``.

    probs: [T, E] router probabilities; expert_ids: [T, K] the router's choices (ids < 0 are ignored
    but still count in the T * K denominator). f_i comes from a hard choice, so no gradient flows
    through it.
    """
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
            raise ValueError(
                f"other: shape {(other.num_layers, other.num_experts)} != {(self.num_layers, self.num_experts)}"
            )
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
        """Per layer: f_i, P_i, the Switch balance term, max/mean expert load, overflow counts.

        ``balance`` is ``N * sum_i f_i * P_i`` (1.0 = even); ``imbalance`` is max/mean of the load
        the experts actually served (1.0 = even). Layers with no tokens report None for both.
        """
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
            layers.append(
                {
                    "layer": layer,
                    "tokens": tokens,
                    "routes": routes,
                    "f": f,
                    "P": p,
                    "balance": balance,
                    "imbalance": imbalance,
                    "dropped": int(self.dropped[layer]),
                    "rerouted": int(self.rerouted[layer]),
                }
            )
        return layers
