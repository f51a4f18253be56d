"""The dispatch plan: how one rank's routes are laid out for the all-to-all.

The kept routes (expert id >= 0) of the flattened [T * K] route list are ordered by destination
rank, then local expert slot, then route index, so ``send_counts`` are ``all_to_all_single``'s
``input_split_sizes``:

    x_sent = x_kept[plan.order]              # dispatch
    x_kept = y_received[plan.inverse_order]  # combine, after the all-to-all back

Shapes: T tokens, K = top_k, R kept routes, W ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from router_service.placement import Placement


@dataclass
class DispatchPlan:
    """One rank's send layout.

    order:         [R] indices into the kept routes (in route order), giving the send order
    inverse_order: [R] the inverse permutation: ``order[inverse_order] == arange(R)``
    route_index:   [R] flat route index (t * K + k) of each sent row
    token_index:   [R] token of each sent row (the hidden-state row to gather)
    dest_rank:     [R] destination rank of each sent row (non-decreasing)
    local_expert:  [R] slot of the expert on its destination rank
    send_counts:   [W] rows sent to each rank (python ints, for all_to_all_single)
    slot_counts:   [W, S] rows sent to each slot of each rank (S: the most slots any rank has)
    """

    order: Tensor
    inverse_order: Tensor
    route_index: Tensor
    token_index: Tensor
    dest_rank: Tensor
    local_expert: Tensor
    send_counts: list[int]
    slot_counts: Tensor


def build_dispatch_plan(expert_ids: Tensor, placement: Placement, world_size: int | None = None) -> DispatchPlan:
    """Plan the all-to-all for routed ``expert_ids`` [T, K] (-1 = dropped) under ``placement``;
    a replicated expert is served by replica ``token % replicas`` (``Placement.ranks_of``)."""
    if world_size is not None and world_size != placement.world_size:
        raise ValueError(f"world_size: {world_size} != placement.world_size {placement.world_size}")
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids: expected [T, K], got shape {tuple(expert_ids.shape)}")
    if expert_ids.numel() and int(expert_ids.max()) >= placement.num_experts:
        raise ValueError(f"expert_ids: id {int(expert_ids.max())} >= placement.num_experts {placement.num_experts}")
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [T * K]
    kept_routes = torch.nonzero(flat >= 0).squeeze(1)  # [R]
    experts = flat[kept_routes]  # [R]
    tokens = kept_routes // top_k  # [R]
    ranks = placement.ranks_of(experts, tokens)  # [R]
    slots = placement.local_slots(experts, ranks)  # [R]

    max_slots = max(len(r) for r in placement.rank_experts)
    key = ranks * max_slots + slots  # [R]
    order = torch.sort(key, stable=True).indices  # [R]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    slot_counts = torch.bincount(key, minlength=placement.world_size * max_slots).view(-1, max_slots)  # [W, S]
    return DispatchPlan(order, inverse, route_index=kept_routes[order], token_index=tokens[order],
                        dest_rank=ranks[order], local_expert=slots[order],
                        send_counts=slot_counts.sum(dim=1).tolist(), slot_counts=slot_counts)
