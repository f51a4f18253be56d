"""Expert parallelism: routes travel to the rank holding their expert by all-to-all and come back.

Shapes: N tokens on this rank, K routes per token, D hidden, R routes this rank sends,
Q routes it receives, W ranks, S the most expert slots any rank holds, El this rank's slots,
C = max_tokens * K rows per destination in the padded exchange.

Per MoE layer, three collectives on the shard group (a rank with no tokens still takes part):

- exact (prefill, and every pass on the CPU): routes planned on the host
  (router_service/dispatch_plan.py); ranks exchange row counts per expert slot, then exactly
  those rows, and the outputs come back the same way.
- padded (decode and verify on a GPU, as DeepEP's low-latency mode): every rank sends every
  other C rows, each tagged with its slot (-1: padding); the receiver sorts by slot and runs the
  grouped matmul with group ends computed on the device, so nothing is read on the host. The
  step driver sets `max_tokens` so all ranks agree on C. On gloo it only moves more bytes.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from model_shards.device import collective_backend
from model_shards.moe import Dispatch, LocalExperts, phase
from router_service.dispatch_plan import build_dispatch_plan
from router_service.placement import Placement

# More tokens on some rank (a prefill): the exact layout, as DeepEP's switch to its normal mode.
PADDED_MAX_TOKENS = 256


def init_shard_group(rank: int, world_size: int, master: str, timeout_s: float = 30.0,
                     device: torch.device | str = "cpu") -> None:
    """Join the shard group (`master`: rank 0's "host:port") with the backend for this rank's
    `device`; a dead peer makes collectives fail within `timeout_s`."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    dist.init_process_group(collective_backend(device), init_method=f"tcp://{master}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def wait_for_group(rank: int, world_size: int, timeout_s: float = 600.0) -> None:
    """Return once every rank has called this, on the store: start-up outlasts a collective's timeout."""
    if not dist.is_initialized():
        return
    store = dist.distributed_c10d._get_default_store()
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))


class AllToAllDispatch(Dispatch):
    """`padded` (None: on a GPU) unless `max_tokens` (any rank's most this pass) is None or too many."""

    def __init__(self, placement: Placement, rank: int, group: dist.ProcessGroup | None = None,
                 padded: bool | None = None) -> None:
        self.placement, self.rank, self.group, self.padded = placement, rank, group, padded
        self.max_tokens: int | None = None

    def route(self, x: torch.Tensor, expert_ids: torch.Tensor, experts: LocalExperts) -> torch.Tensor:
        padded = self.padded if self.padded is not None else x.device.type == "cuda"
        if padded and self.max_tokens is not None and self.max_tokens <= PADDED_MAX_TOKENS:
            if x.shape[0] > self.max_tokens:
                raise ValueError(f"{x.shape[0]} tokens routed, more than max_tokens={self.max_tokens}")
            return self._route_padded(x, expert_ids, experts)
        return self._route_exact(x, expert_ids, experts)

    def _route_exact(self, x: torch.Tensor, expert_ids: torch.Tensor, experts: LocalExperts) -> torch.Tensor:
        n, k = expert_ids.shape
        d, w = x.shape[-1], self.placement.world_size
        with phase("dispatch"):
            plan = build_dispatch_plan(expert_ids.cpu(), self.placement)
            token_index, route_index = plan.token_index.to(x.device), plan.route_index.to(x.device)
            recv_counts = torch.empty_like(plan.slot_counts.to(x.device))  # [W, S]
            dist.all_to_all_single(recv_counts, plan.slot_counts.to(x.device), group=self.group)
            recv_counts = recv_counts.cpu()  # from each rank, rows for each of this rank's slots
            recv_splits = recv_counts.sum(dim=1).tolist()
            recv = x.new_empty(sum(recv_splits), d)  # [Q, D]: by source rank, then by slot
            dist.all_to_all_single(recv, x[token_index], recv_splits, plan.send_counts, group=self.group)

        with phase("experts"):
            slots = torch.arange(recv_counts.shape[1]).repeat(w)  # [W*S]
            local = torch.repeat_interleave(slots, recv_counts.reshape(-1))  # [Q] slot of each received row
            order = torch.argsort(local, stable=True).to(x.device)
            counts = recv_counts.sum(dim=0)[: experts.num_local].tolist()
            y = torch.empty_like(recv)  # [Q, D]
            y[order] = experts(recv[order], counts)

        with phase("combine"):
            back = x.new_empty(len(route_index), d)  # [R, D]
            dist.all_to_all_single(back, y, plan.send_counts, recv_splits, group=self.group)
            out = x.new_zeros(n * k, d)  # [N*K, D]
            out[route_index] = back
        return out.view(n, k, d)

    def _route_padded(self, x: torch.Tensor, expert_ids: torch.Tensor, experts: LocalExperts) -> torch.Tensor:
        n, k = expert_ids.shape
        d, w, c = x.shape[-1], self.placement.world_size, self.max_tokens * k
        dev = x.device
        with phase("dispatch"):
            flat = expert_ids.reshape(-1)  # [N*K]
            token = torch.arange(n * k, device=dev) // k  # [N*K]
            ranks = self.placement.ranks_of(flat, token)  # [N*K], -1 for a dropped route
            slot = self.placement.local_slots(flat, ranks)  # [N*K]
            dest = torch.where(ranks >= 0, ranks, w)  # [N*K]; dropped routes to bucket W, never sent
            s = max(len(r) for r in self.placement.rank_experts)
            order = torch.sort(dest * (s + 1) + slot + 1, stable=True).indices  # [N*K] by rank, slot, route
            per_dest = torch.zeros(w + 1, dtype=torch.long, device=dev).scatter_add_(0, dest, torch.ones_like(dest))
            first = per_dest.cumsum(0) - per_dest  # [W+1] where each destination's routes start in `order`
            row = torch.empty_like(dest)  # [N*K] each route's row in the send buffer
            row[order] = dest[order] * c + torch.arange(n * k, device=dev) - first[dest[order]]
            send = x.new_zeros((w + 1) * c, d)  # [(W+1)*C, D]
            send[row] = x[token]
            send_slot = torch.full(((w + 1) * c,), -1, dtype=torch.long, device=dev)  # [(W+1)*C]
            send_slot[row] = slot
            recv, recv_slot = x.new_empty(w * c, d), send_slot.new_empty(w * c)  # [W*C, D], [W*C]
            dist.all_to_all_single(recv_slot, send_slot[: w * c], group=self.group)
            dist.all_to_all_single(recv, send[: w * c], group=self.group)

        with phase("experts"):
            el = experts.num_local
            key = torch.where(recv_slot >= 0, recv_slot, el)  # [W*C]; padding sorts last
            by_slot = torch.sort(key, stable=True).indices  # [W*C]
            per_slot = torch.zeros(el + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
            ends = per_slot[:el].cumsum(0).to(torch.int32)  # [El]
            y = torch.empty_like(recv)  # [W*C, D]
            y[by_slot] = experts.forward_ends(recv[by_slot], ends)

        with phase("combine"):
            back = x.new_zeros((w + 1) * c, d)  # [(W+1)*C, D]: bucket W stays zero for dropped routes
            dist.all_to_all_single(back[: w * c], y, group=self.group)
            out = back[row]  # [N*K, D]
        return out.view(n, k, d)
