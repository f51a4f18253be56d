"""The shard group on Ray: W-1 shard actors in a placement group + rank 0 in the engine's process.

Ray places, starts and supervises the processes and carries a few calls per group lifetime
(start, health, stats); the per-step data plane is torch.distributed between the ranks
(model_shards/shard_worker.py). Experts can move between ranks while the group serves
(`replace`). If a shard dies, rank 0's next collective fails (at the latest after the group
timeout) and the engine calls `recover()`: the ranks still alive form the group again among
themselves, in the same processes with the weights they hold, and take over the dead ranks'
experts (with `shards.redundancy` 1 each expert already has a second home, so nothing is read;
with 0 the survivors read just the lost experts from the checkpoint). Running requests recompute
their KV on the smaller group. Only when no rank died, or re-forming fails, `restart()` forms a
fresh group of the configured width (with the router service's placement, if it has one).

The placement group holds a bundle per rank, rank 0's included: rank 0 already runs (in the
engine replica, whose resources Serve reserved), so its bundle is a token pinned to that node by
Ray's node-id label. `shards.strategy` then places every rank: STRICT_SPREAD puts each on a node
of its own, STRICT_PACK all of them on the replica's node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from model_shards.all_to_all import init_shard_group
from model_shards.device import resolve_device, resolve_dtype
from model_shards.local_group import free_port, load_shard
from model_shards.shard_worker import ShardedRunner, ShardWorker
from moeserve.config import EngineSection, ModelSection, RoutingSection, ShardsSection, default_of
from router_service.placement import Placement, contiguous_placement, with_second_homes, without_ranks

log = logging.getLogger(__name__)

# Rank 0's bundle: what it asks of the replica's node (which must have it free) only to pin the group there.
RANK0_BUNDLE = {"CPU": 0.001}


@dataclass(frozen=True)
class ShardGroupConfig:
    checkpoint: str
    world_size: int = 2
    max_num_seqs: int = default_of(EngineSection, "max_num_seqs")  # per rank
    max_model_len: int = default_of(EngineSection, "max_model_len")
    block_size: int = default_of(EngineSection, "block_size")  # each rank's paged KV cache
    prefix_caching: bool = default_of(EngineSection, "prefix_caching")
    compile: bool = default_of(EngineSection, "compile")  # each rank's decode and verify passes compiled between its collectives
    routing: RoutingSection = field(default_factory=RoutingSection)
    dtype: str = default_of(ModelSection, "dtype")  # every rank's weights and KV cache (auto: bfloat16 on a GPU, float32 on the CPU)
    strategy: str = default_of(ShardsSection, "strategy")  # of every rank, rank 0's node included (module docstring)
    gpus_per_shard: float = default_of(ShardsSection, "gpus_per_shard")  # 1 on a GPU cluster (NCCL), 0 on CPU
    redundancy: int = default_of(ShardsSection, "redundancy")  # 1: every expert on two ranks
    cpus_per_shard: float = 1.0
    timeout_s: float = 30.0  # a dead peer fails a collective within this
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {self.world_size}")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"strategy: must be a Ray placement strategy, got {self.strategy!r}")
        if not Path(self.checkpoint).is_dir():
            raise ValueError(f"checkpoint: folder not found: {self.checkpoint}")
        if self.redundancy and self.world_size < 2:
            raise ValueError("redundancy: a second home for every expert needs at least 2 ranks")
        if self.gpus_per_shard:  # rank 0 runs in this process: say so now, not after a placement group waits
            resolve_device(self.device)

    @property
    def device(self) -> torch.device:
        """Where every rank runs: its own GPU (Ray sets each actor's visible GPU) when shards get GPUs."""
        return torch.device("cuda" if self.gpus_per_shard else "cpu")


def _join_and_load(cfg: ShardGroupConfig, placement: Placement, rank: int, master: str) -> tuple:
    """Join the group's process group and load this rank's shard on the group's device: the
    model, its expert-load counters and what the group reports of the shard."""
    device = resolve_device(cfg.device)
    init_shard_group(rank, cfg.world_size, master, cfg.timeout_s, device)
    model = load_shard(cfg.checkpoint, placement, rank, cfg.routing, resolve_dtype(cfg.dtype, device), device)
    info = {"rank": rank, "experts": list(placement.rank_experts[rank]), "loaded_bytes": model.loaded_bytes,
            "node_id": ray.get_runtime_context().get_node_id()}
    return model, model.enable_stats(), info


def _join_again(cfg: ShardGroupConfig, rank: int, world_size: int, master: str) -> None:
    """Leave the broken group and join the re-formed one as `rank` (weights stay loaded)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    init_shard_group(rank, world_size, master, cfg.timeout_s, resolve_device(cfg.device))


@ray.remote
class ShardActor:
    """Ranks 1..W-1: the worker loop runs in a thread; Ray methods (health, stats) stay responsive."""

    def __init__(self, cfg: ShardGroupConfig, placement: Placement, rank: int, master: str) -> None:
        self.cfg, self.placement, self.rank, self.master = cfg, placement, rank, master
        self.thread: threading.Thread | None = None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.stats = None
        self.error: str | None = None

    def start(self) -> dict:
        self.model, self.stats, info = _join_and_load(self.cfg, self.placement, self.rank, self.master)
        self._serve(ShardWorker(self.model, self.rank, self.cfg.world_size, self.cfg.max_num_seqs,
                                self.cfg.max_model_len, self.cfg.block_size, self.cfg.compile))
        return info

    def rejoin(self, rank: int, world_size: int, master: str, placement: Placement, max_num_seqs: int) -> dict:
        """Join the survivors' group as `rank` once this rank's loop has seen the old group end."""
        if self.thread is not None:
            self.thread.join(self.cfg.timeout_s)
            if self.thread.is_alive():
                raise RuntimeError(f"rank {self.rank} is still in the old group after {self.cfg.timeout_s} s")
        self.rank, self.error = rank, None
        _join_again(self.cfg, rank, world_size, master)
        worker = ShardWorker(self.model, rank, world_size, max_num_seqs, self.cfg.max_model_len, self.cfg.block_size,
                             self.cfg.compile)
        worker.place(placement)  # reads only the experts this rank did not hold
        self._serve(worker)
        return {"rank": rank, "experts": list(placement.rank_experts[rank]), "node_id": self.node_id}

    def _serve(self, worker: ShardWorker) -> None:
        self.thread = threading.Thread(target=self._loop, args=(worker,), daemon=True)
        self.thread.start()

    def _loop(self, worker: ShardWorker) -> None:
        try:
            worker.serve_forever()
        except Exception as e:  # the group broke (a peer died); the owner re-forms or restarts it
            self.error = f"{type(e).__name__}: {e}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def health(self) -> dict:
        return {"rank": self.rank, "alive": bool(self.thread and self.thread.is_alive()), "error": self.error,
                "node_id": self.node_id}

    def get_stats(self) -> dict | None:
        return self.stats.to_dict() if self.stats is not None else None


class ShardGroup:
    """Owns one expert-parallel group; `start()` returns rank 0's runner for the engine."""

    def __init__(self, cfg: ShardGroupConfig, placement: Placement | None = None) -> None:
        from model_shards.config import ModelConfig

        self.cfg = cfg
        self.model_config = ModelConfig.from_file(cfg.checkpoint)
        self.placement = self._homes(placement or contiguous_placement(self.model_config.num_experts, cfg.world_size))
        self.actors: list = []
        self.pg = None
        self.runner: ShardedRunner | None = None
        self.stats = None
        self.shard_info: list[dict] = []
        self.generation = 0  # how many times the group was (re)formed
        self.width = cfg.world_size  # ranks now: fewer than configured after a rank died
        self.rank_failures_survived = 0
        self.last_recovery_s = 0.0  # the last re-form's pause: dead rank found to group serving again

    def _homes(self, placement: Placement) -> Placement:
        """`placement` with a second home for every expert when the config asks for redundancy."""
        return with_second_homes(placement) if self.cfg.redundancy else placement

    def start(self) -> ShardedRunner:
        cfg, world = self.cfg, self.cfg.world_size
        if self.placement.world_size != world:  # after a shrink: the configured width again
            self.placement = self._homes(contiguous_placement(self.model_config.num_experts, world))
        master = f"{ray.util.get_node_ip_address()}:{free_port()}"
        if world > 1:
            bundle = {"CPU": cfg.cpus_per_shard} | ({"GPU": cfg.gpus_per_shard} if cfg.gpus_per_shard else {})
            here = {NODE_ID_LABEL_KEY: ray.get_runtime_context().get_node_id()}
            self.pg = placement_group([RANK0_BUNDLE] + [bundle] * (world - 1), strategy=cfg.strategy,
                                      bundle_label_selector=[here] + [{}] * (world - 1))
            ray.get(self.pg.ready(), timeout=cfg.start_timeout_s)
            self.actors = [ShardActor.options(
                num_cpus=cfg.cpus_per_shard, num_gpus=cfg.gpus_per_shard, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote(cfg, self.placement, r, master) for r in range(1, world)]
        started = [a.start.remote() for a in self.actors]
        model, self.stats, info = _join_and_load(cfg, self.placement, 0, master)  # blocks until every rank joined
        # returns once every rank is ready (each rank's start returns only then)
        self.runner = ShardedRunner(model, world, cfg.max_num_seqs, cfg.max_model_len, cfg.block_size,
                                    cfg.prefix_caching, cfg.compile)
        self.shard_info = [info] + ray.get(started, timeout=cfg.start_timeout_s)
        self.generation += 1
        self.width = world
        log.info("shard group %d formed: %s", self.generation, self.shard_info)
        return self.runner

    def stop(self, graceful: bool = True) -> None:
        if self.runner is not None and graceful:
            try:
                self.runner.shutdown()
            except Exception:  # the group is already broken
                pass
        self.runner = None
        if dist.is_initialized():
            dist.destroy_process_group()
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def restart(self, placement: Placement | None = None) -> ShardedRunner:
        """Tear the (possibly broken) group down and form a new one, optionally with a new placement."""
        self.stop(graceful=False)
        if placement is not None:
            self.placement = self._homes(placement)
        return self.start()

    def recover(self, propose: Callable[[], Placement | None] = lambda: None) -> ShardedRunner:
        """After a failed step: the live ranks form the group again without the dead (module
        docstring); a restart, with `propose()`'s placement, when none died or that fails."""
        t0 = time.monotonic()
        if dist.is_initialized():
            dist.destroy_process_group()  # a survivor still waiting on rank 0 sees its group end
        answers = [a.health.remote() for a in self.actors]
        alive = []
        for rank, (actor, answer) in enumerate(zip(self.actors, answers), 1):
            try:
                ray.get(answer, timeout=self.cfg.timeout_s)
                alive.append((rank, actor))
            except Exception:  # the actor (or its node) is gone
                ray.kill(actor, no_restart=True)
        dead = set(range(1, self.width)) - {r for r, _ in alive}
        if not dead or self.runner is None:
            return self.restart(propose())
        try:
            return self._reform(alive, dead, t0)
        except Exception:
            log.exception("re-forming the shard group without rank(s) %s failed; restarting it", sorted(dead))
            return self.restart(propose())

    def _reform(self, alive: list, dead: set[int], t0: float) -> ShardedRunner:
        cfg, world = self.cfg, 1 + len(alive)
        placement = without_ranks(self.placement, dead)
        per_rank = -(-cfg.max_num_seqs * cfg.world_size // world)  # the whole batch still fits
        master = f"{ray.util.get_node_ip_address()}:{free_port()}"
        joined = [a.rejoin.remote(new, world, master, placement, per_rank) for new, (_, a) in enumerate(alive, 1)]
        model, self.runner = self.runner.model, None
        _join_again(cfg, 0, world, master)
        self.runner = ShardedRunner(model, world, per_rank, cfg.max_model_len, cfg.block_size, cfg.prefix_caching,
                                    cfg.compile)
        self.runner.place(placement)
        others = ray.get(joined, timeout=cfg.start_timeout_s)
        self.actors, self.placement, self.width = [a for _, a in alive], placement, world
        self.shard_info = [{**self.shard_info[0], "experts": list(placement.rank_experts[0])}] + others
        self.generation += 1
        self.rank_failures_survived += len(dead)
        self.last_recovery_s = time.monotonic() - t0
        log.warning("shard group %d: rank(s) %s died; %d ranks serve on after %.2f s without a restart",
                    self.generation, sorted(dead), world, self.last_recovery_s)
        return self.runner

    def replace(self, placement: Placement) -> None:
        """Live re-placement: every rank moves to `placement` now (between two steps, on the
        engine core's thread); a later re-form keeps it."""
        self.runner.replace(placement)
        self.placement = placement
        for info in self.shard_info:
            info["experts"] = list(placement.rank_experts[info["rank"]])

    def health(self, timeout_s: float = 5.0) -> list[dict]:
        """Every rank's liveness and node, rank 0 (this process) first."""
        own = [{"rank": 0, "alive": self.runner is not None, "error": None,
                "node_id": ray.get_runtime_context().get_node_id()}]
        try:
            return own + ray.get([a.health.remote() for a in self.actors], timeout=timeout_s)
        except Exception as e:
            return own + [{"alive": False, "error": f"{type(e).__name__}: {e}"}]

    def collect_stats(self, timeout_s: float = 5.0) -> list[dict]:
        """Cumulative expert-load counters of every rank (rank 0 first); called periodically, not per step."""
        own = [self.stats.to_dict()] if self.stats is not None else []
        try:
            others = ray.get([a.get_stats.remote() for a in self.actors], timeout=timeout_s)
        except Exception:
            others = []
        return own + [s for s in others if s is not None]
