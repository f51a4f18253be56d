"""How routed tokens reach their experts: the `Dispatch` interface and its single-process reference.

Shapes: N tokens, K routes per token, D hidden, R kept routes, E experts.

Every implementation returns per-route expert outputs in the caller's [N, K] order; the
weighted sum over K (`combine`) is shared, so the single-process and all-to-all paths add
the same numbers in the same order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from model_shards.experts import LocalExperts
from model_shards.profiling import phase


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

    def __call__(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: LocalExperts
    ) -> torch.Tensor:
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
