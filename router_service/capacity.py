"""Expert capacity and what happens to the routes that overflow it.

An expert processes at most ``capacity`` routes per step. When more routes choose it, the
ones with the highest router probability win (ties: lower token index, then lower top-k slot),
the same ordering as DeepSpeed's ``drop_policy="probs"``. The losers either

- ``drop``:    contribute nothing (weight 0, expert id -1); the residual connection carries the token;
- ``reroute``: move to the token's next-best expert that still has room, else drop;
- ``none``:    never happens: every route is kept (exact, no limit).

Shapes: T tokens, E experts, K = top_k, R = T * K routes, P pending (overflowing) routes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

import torch
from torch import Tensor

from router_service.gating import Gates

OverflowPolicy = Literal["none", "drop", "reroute"]


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int) -> int:
    """``max(min_capacity, ceil(capacity_factor * tokens * k / experts))`` routes per expert, with
    capacity_factor read as the decimal written (1.1 * 10 * 2 / 2 is 11, not 12 by float rounding)."""
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
    """Enforce ``capacity`` routes per expert on ``gates`` under ``policy`` (None: no limit); priority
    by router probability ``probs[t, e]`` (the normalised weight is always 1.0 for top-1).

    Reroute runs in rounds r = 0, 1, ...: each token with overflowing routes asks for its r-th
    best unchosen expert, which takes askers in priority order while it has room, one route per
    token per round. Routes left without a candidate with room are dropped (at most E - K rounds).

    A rerouted route gets the new expert's weight under the token's own normalisation,
    ``probs[t, new] * sum(gate weights) / sum(chosen probs)``; the token's other weights stay as
    they are (nothing is renormalised). ``sigmoid_bias`` ranks by the unbiased scores in ``probs``.
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
    shape = (num_tokens, top_k)
    return Routed(weights.view(shape), new_ids.view(shape), kept.view(shape), rerouted.view(shape),
                  num_dropped=int((~kept).sum()), num_rerouted=int(rerouted.sum()))


def _reroute(gates: Gates, probs: Tensor, pending: Tensor, room: Tensor, new_ids: Tensor, rerouted: Tensor,
             weights: Tensor) -> None:
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

    # `open_rounds`: rounds that might accept someone (room and pending only shrink; refreshed when fruitless)
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
