"""One rank's shard of a checkpoint, and a free local port: what a shard group's ranks need, whether
they run as Ray actors (deployments/shard_group.py) or as plain processes (bench/local_group.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from model_shards.all_to_all import AllToAllDispatch
from model_shards.loader import load_checkpoint
from model_shards.model import CausalLM
from moeserve.config import RoutingSection
from router_service.placement import Placement


def load_shard(checkpoint: str | Path, placement: Placement | None, rank: int, routing: RoutingSection | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", padded: bool | None = None,
               ) -> CausalLM:
    """This rank's model: dense weights + only its experts, wired to the all-to-all when W > 1
    (`padded`: its layout, model_shards/all_to_all.py; None: by device)."""
    experts = placement.rank_experts[rank] if placement is not None else None
    model = load_checkpoint(checkpoint, dtype, experts=experts, device=device)
    if placement is not None and placement.world_size > 1:
        model.set_dispatch(AllToAllDispatch(placement, rank, padded=padded))
    if routing is not None:
        model.set_routing(routing)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
