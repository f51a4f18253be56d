"""A shard group as plain local processes (no Ray): for tests, benchmarks and single-host use.
The Ray deployment (deployments/shard_group.py) does the same with actors."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_shards.all_to_all import init_shard_group
from model_shards.config import ModelConfig
from model_shards.device import resolve_dtype
from model_shards.local_group import free_port, load_shard
from model_shards.model import CausalLM
from model_shards.shard_worker import ShardedRunner, ShardWorker
from moeserve.config import EngineSection, RoutingSection, default_of
from router_service.placement import Placement, contiguous_placement


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a local group on "cuda" uses GPU r; on the CPU every rank uses the CPU."""
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def _join(checkpoint: str | Path, placement: Placement, routing: RoutingSection | None, device: str, dtype: str,
          padded: bool | None, rank: int, master: str) -> CausalLM:
    """Join the group (`master`: rank 0's "host:port") and load this rank's shard."""
    dev = rank_device(device, rank)
    init_shard_group(rank, placement.world_size, master, device=dev)
    return load_shard(checkpoint, placement, rank, routing, resolve_dtype(dtype, dev), dev, padded)


def _follower(join: partial, sizes: tuple, compile: bool, threads: int, rank: int, master: str) -> None:
    torch.set_num_threads(threads)
    model = join(rank, master)
    try:
        ShardWorker(model, rank, *sizes, compile).serve_forever()
    finally:
        dist.destroy_process_group()


class LocalShardGroup:
    """W-1 follower processes + rank 0 in this process. Use as a context manager."""

    def __init__(self, checkpoint: str | Path, world_size: int,
                 max_num_seqs: int = default_of(EngineSection, "max_num_seqs"),
                 max_model_len: int = default_of(EngineSection, "max_model_len"),
                 block_size: int = default_of(EngineSection, "block_size"),
                 prefix_caching: bool = default_of(EngineSection, "prefix_caching"),
                 placement: Placement | None = None, routing: RoutingSection | None = None, threads_per_rank: int = 1,
                 device: str = "cpu", dtype: str = "auto", compile: bool = False, padded: bool | None = None) -> None:
        cfg = ModelConfig.from_file(checkpoint)
        self.placement = placement or contiguous_placement(cfg.num_experts, world_size)
        if self.placement.world_size != world_size:
            raise ValueError(f"placement is for {self.placement.world_size} ranks, not {world_size}")
        self.join = partial(_join, checkpoint, self.placement, routing, device, dtype, padded)  # (rank, master)
        self.sizes = (world_size, max_num_seqs, max_model_len, block_size)
        self.threads, self.compile, self.prefix_caching = threads_per_rank, compile, prefix_caching
        self.runner: ShardedRunner | None = None
        self.procs: list = []

    def __enter__(self) -> ShardedRunner:
        master = f"127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_follower, args=(self.join, self.sizes, self.compile, self.threads, r, master),
                                  daemon=True) for r in range(1, self.placement.world_size)]
        for p in self.procs:
            p.start()
        self.runner = ShardedRunner(self.join(0, master), *self.sizes, self.prefix_caching, self.compile)
        return self.runner

    def __exit__(self, *exc) -> None:
        try:
            if self.runner is not None and exc[0] is None:
                self.runner.shutdown()
        finally:
            dist.destroy_process_group()
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
