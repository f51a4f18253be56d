"""Expert capacity and what happens to the routes that overflow it.

An expert processes at most ``capacity`` routes per step. When more routes choose it, the
ones with the highest router probability win (ties: lower token index, then lower top-k slot),
the same ordering as DeepSpeed's ``drop_policy="probs"``. The losers either

- ``drop``:    contribute nothing (weight 0, expert id -1); the residual connection carries the token;
- ``reroute``: move to the token's next-best expert that still has room, else drop;
- ``none``:    never happens: every route is kept (exact, no limit).

Expert-load statistics (`ExpertLoadStats`) and the Switch Transformer balance term: for N experts, f_i is the fraction of routes the router sends to expert i and P_i the mean
router probability of expert i. With top-k routing f_i counts routes divided by T * k, so
sum_i f_i = 1 and the balance term ``N * sum_i f_i * P_i`` is 1.0 for a perfectly even router
whatever k is (seeds: balanced 1.0, collapsed 2.8, in units of alpha). This equals DeepSpeed's
``topkgating`` l_aux; transformers' ``load_balancing_loss_func`` counts f_i per top-k slot and
is k times larger.

Shapes: T tokens, E experts (= N), K = top_k, R = T * K routes, P pending (overflowing) routes,
L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from router_service.gating import Gates

OverflowPolicy = Literal["none", "drop", "reroute"]


def expert_capacity(
    num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int
) -> int:
    """Routes one expert may take: ``max(min_capacity, ceil(capacity_factor * tokens * k / experts))``.

    ``capacity_factor`` is read as the decimal it was written as (1.1 means 11/10), so an exact
    product is not pushed over an integer by float rounding (1.1 * 10 * 2 / 2 is 11, not 12).
    """
    if num_tokens < 0 or num_experts < 1 or top_k < 1:
        raise ValueError(f"num_tokens/num_experts/top_k: need >= 0/1/1, got {num_tokens}/{num_experts}/{top_k}")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor: must be > 0, got {capacity_factor}")
    if min_capacity < 0:
        raise ValueError(f"min_capacity: must be >= 0, got {min_capacity}")
    exact = Fraction(repr(float(capacity_factor))) * num_tokens * top_k / num_experts
    return max(min_capacity, math.ceil(exact))


@dataclass
class Routed:
    """Routes after the capacity limit.

    weights:    [T, K] combine weight; 0 for dropped routes; the new expert's weight for rerouted ones
    expert_ids: [T, K] int64 expert that processes the route; -1 if dropped
    kept:       [T, K] bool, the route is processed (by its first choice or after a reroute)
    rerouted:   [T, K] bool, the route moved to another expert
    """

    weights: Tensor
    expert_ids: Tensor
    kept: Tensor
    rerouted: Tensor
    num_dropped: int
    num_rerouted: int


def apply_capacity(gates: Gates, capacity: int | None, policy: OverflowPolicy = "drop") -> Routed:
    """Enforce ``capacity`` routes per expert on ``gates`` under ``policy``.

    Priority when an expert is full: the route's router probability ``probs[t, e]`` (what DeepSpeed
    sorts by; the normalised weight would not rank anything for Mixtral-style top-1, where it is
    always 1.0), highest first; ties by token index, then top-k slot.

    Reroute proceeds in rounds r = 0, 1, ...: each token still holding overflowing routes asks for
    its r-th best expert by router probability among those it did not choose; the expert takes
    askers in priority order while it has room, and at most one route per token per round (the
    token's highest-priority one; the others ask again next round). Routes left when the
    candidates run out, or when no candidate has room, are dropped. One round is vectorised, and
    rounds in which no candidate has room are skipped, so the loop runs at most E - K times.

    A rerouted route keeps the weight the gate would give the new expert with the token's own
    normalisation: ``probs[t, new] * (sum of the token's gate weights / sum of its chosen probs)``,
    i.e. ``probs[t, new] / sum_topk(probs)`` for Mixtral, ``probs[t, new]`` for un-normalised
    Qwen/OLMoE, ``score * scaling / sum_topk(score)`` for DeepSeek. The token's other weights stay
    as they are (as with ``drop``, nothing is renormalised), so for the softmax styles a route
    pushed to a worse expert contributes less. For ``sigmoid_bias`` the ranking uses the unbiased
    scores in ``probs`` (Gates does not carry the selection bias).

    ``capacity=None`` means no limit, the same as ``policy="none"``.
    """
    if policy not in get_args(OverflowPolicy):
        raise ValueError(f"policy: {policy!r} is not one of {get_args(OverflowPolicy)}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity: must be >= 0, got {capacity}")
    ids = gates.expert_ids  # [T, K]
    num_tokens, top_k = ids.shape
    if policy == "none" or capacity is None:
        kept = torch.ones_like(ids, dtype=torch.bool)
        return Routed(gates.weights, ids, kept, torch.zeros_like(kept), num_dropped=0, num_rerouted=0)

    probs = gates.probs.float()  # [T, E]
    score = probs.gather(1, ids)  # [T, K] priority key of every route
    order = torch.sort(score.reshape(-1), descending=True, stable=True).indices  # [R] routes by priority
    flat_ids = ids.reshape(-1)  # [R]
    kept_flat = torch.zeros_like(flat_ids, dtype=torch.bool)  # [R]
    kept_flat[order] = _rank_within_group(flat_ids[order]) < capacity
    new_ids = torch.where(kept_flat, flat_ids, -1)  # [R]
    rerouted = torch.zeros_like(kept_flat)  # [R]
    weights = gates.weights.reshape(-1).clone()  # [R]

    pending = order[~kept_flat[order]]  # [P] overflowing routes, still in priority order
    if policy == "reroute" and pending.numel() > 0:
        room = capacity - torch.bincount(flat_ids[kept_flat], minlength=gates.num_experts)  # [E]
        _reroute(gates, probs, pending, room, new_ids, rerouted, weights)

    kept = new_ids >= 0  # [R]
    weights = torch.where(kept, weights, torch.zeros_like(weights))
    return Routed(
        weights=weights.view(num_tokens, top_k),
        expert_ids=new_ids.view(num_tokens, top_k),
        kept=kept.view(num_tokens, top_k),
        rerouted=rerouted.view(num_tokens, top_k),
        num_dropped=int((~kept).sum()),
        num_rerouted=int(rerouted.sum()),
    )


def _reroute(
    gates: Gates, probs: Tensor, pending: Tensor, room: Tensor, new_ids: Tensor, rerouted: Tensor, weights: Tensor
) -> None:
    """Place ``pending`` routes (priority order) on their tokens' next-best experts; writes in place."""
    if int(room.sum()) == 0:
        return  # every expert is full: all pending routes are dropped
    ids = gates.expert_ids  # [T, K]
    top_k, num_experts = ids.shape[1], gates.num_experts
    tokens, row = torch.unique(pending // top_k, return_inverse=True)  # [U], [P] row of each route's token
    unchosen = probs[tokens].scatter(1, ids[tokens], float("-inf"))  # [U, E]
    # Stable descending sort: equal probabilities go to the lower expert id, chosen experts last.
    candidates = torch.sort(unchosen, dim=1, descending=True, stable=True).indices  # [U, E]
    # The weight a route would get on expert e is probs[t, e] times the token's own normalisation.
    chosen_prob = probs.gather(1, ids).sum(dim=1)  # [T]
    scale = gates.weights.float().sum(dim=1) / chosen_prob.clamp_min(torch.finfo(torch.float32).tiny)  # [T]

    # Room and the pending set only shrink, so a round in which no pending route's candidate has
    # room accepts nobody and can be skipped. `open_rounds` marks the rounds that might accept
    # someone; it can only go stale in the safe direction, and is refreshed after a fruitless round.
    candidates = candidates[:, : num_experts - top_k]  # [U, E - K]
    r, open_rounds = 0, None
    while pending.numel() > 0:
        if open_rounds is None:
            open_rounds = (room[candidates[torch.unique(row)]] > 0).any(dim=0)  # [E - K]
        later = open_rounds[r:].nonzero()
        if later.numel() == 0:
            break
        r += int(later[0])
        want = candidates[row, r]  # [P] the expert each pending route asks for this round
        asks = _rank_within_group(row) == 0  # [P] a token's best-priority pending route asks for it
        fits = _rank_within_group(torch.where(asks, want, num_experts)) < room[want]  # [P]
        won = asks & fits  # [P]
        if won.any():
            route, expert = pending[won], want[won]
            token = route // top_k
            new_ids[route] = expert
            rerouted[route] = True
            weights[route] = (probs[token, expert] * scale[token]).to(weights.dtype)
            room -= torch.bincount(expert, minlength=num_experts)
            pending, row = pending[~won], row[~won]
        else:
            open_rounds = None
        r += 1


def _rank_within_group(keys: Tensor) -> Tensor:
    """Position of each element among the earlier elements with the same key: [5, 3, 5, 5] -> [0, 0, 1, 2]."""
    sorted_keys, perm = torch.sort(keys, stable=True)  # [N]
    counts = torch.bincount(sorted_keys)
    starts = torch.cumsum(counts, 0) - counts  # first position of each key in sorted order
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(keys.numel(), device=keys.device) - starts[sorted_keys]
    return rank


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
