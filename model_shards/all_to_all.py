"""Expert parallelism: routes travel to the rank holding their expert by all-to-all and come back.

Shapes: N tokens on this rank, K routes per token, D hidden, R routes this rank sends,
Q routes it receives, W ranks.

Per MoE layer, three collectives on the shard group: the split sizes, the tokens (with each
route's local expert slot packed as an extra column, so one message carries both), and the
expert outputs back. A rank with no tokens still takes part, sending and receiving nothing.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from model_shards.device import collective_backend
from model_shards.dispatch import Dispatch
from model_shards.experts import LocalExperts
from model_shards.profiling import phase
from router_service.dispatch_plan import build_dispatch_plan
from router_service.placement import Placement


def init_shard_group(
    rank: int, world_size: int, master: str, timeout_s: float = 30.0, device: torch.device | str = "cpu"
) -> None:
    """Join the shard group's process group (`master` is "host:port" of rank 0) with the backend
    for the tensors the ranks exchange: gloo for CPU tensors, NCCL for CUDA ones (`device`: where
    this rank's model runs). A dead peer makes collectives fail within `timeout_s`."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    backend = collective_backend(device)
    dist.init_process_group(
        backend, init_method=f"tcp://{master}", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


class AllToAllDispatch(Dispatch):
    def __init__(self, placement: Placement, rank: int, group: dist.ProcessGroup | None = None) -> None:
        self.placement = placement
        self.rank = rank
        self.group = group

    def route(self, x: torch.Tensor, expert_ids: torch.Tensor, experts: LocalExperts) -> torch.Tensor:
        n, k = expert_ids.shape
        d = x.shape[-1]
        with phase("dispatch"):
            # planned on the CPU (the split sizes are needed there anyway); indices then go to x's device
            plan = build_dispatch_plan(expert_ids.cpu(), self.placement)
            token_index, route_index = plan.token_index.to(x.device), plan.route_index.to(x.device)
            send = torch.cat([x[token_index], plan.local_expert[:, None].to(x.device, x.dtype)], dim=1)  # [R, D+1]
            send_counts = torch.tensor(plan.send_counts, dtype=torch.long, device=x.device)  # [W]
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
            recv_splits = recv_counts.tolist()
            recv = x.new_empty(sum(recv_splits), d + 1)  # [Q, D+1]
            dist.all_to_all_single(recv, send, recv_splits, plan.send_counts, group=self.group)

        with phase("experts"):
            local = recv[:, -1].long()  # [Q] local expert slot of each received route
            order = torch.argsort(local, stable=True)
            counts = torch.bincount(local, minlength=experts.num_local).tolist()
            y = torch.empty_like(recv[:, :d])  # [Q, D]
            y[order] = experts(recv[order, :d], counts)

        with phase("combine"):
            back = x.new_empty(len(route_index), d)  # [R, D]
            dist.all_to_all_single(back, y, plan.send_counts, recv_splits, group=self.group)
            out = x.new_zeros(n * k, d)  # [N*K, D]
            out[route_index] = back
        return out.view(n, k, d)
