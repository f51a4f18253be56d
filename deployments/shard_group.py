"""The shard group on Ray: W-1 shard actors + rank 0 in the engine's process.

Ray places, starts and supervises the processes and carries a few calls per group lifetime; the
per-step data plane is torch.distributed between the ranks (model_shards/shard_worker.py). The
group changes only between two steps, every rank keeping its weights: experts move (`replace`);
after a failed step the live ranks re-form without the dead (`recover`), whose experts have second
homes (`shards.redundancy` 1) or are read from the checkpoint; a rank joins once loaded beside the
serving group, or the last one leaves (`resize`, deployments/elastic.py). Running requests
recompute their KV in the new group. `restart()` forms a fresh group of the configured width.

A placement group holds a bundle per rank, rank 0's a token pinned to the replica's node by label.
`shards.strategy` places every rank (STRICT_SPREAD: a node each; STRICT_PACK: all on the replica's
node); a rank added later takes a dead rank's bundle, or else a node the strategy allows.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from router_service.placement import Placement, contiguous_placement, with_new_rank, with_second_homes, without_ranks

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


def _load(cfg: ShardGroupConfig, placement: Placement, rank: int) -> Any:
    """This rank's model on the group's device: dense weights and its experts under `placement`."""
    device = resolve_device(cfg.device)
    return load_shard(cfg.checkpoint, placement, rank, cfg.routing, resolve_dtype(cfg.dtype, device), device)


def _join(cfg: ShardGroupConfig, rank: int, world_size: int, master: str) -> None:
    """Leave the old group, if any, and join the one formed at `master` as `rank` (weights stay loaded)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    init_shard_group(rank, world_size, master, cfg.timeout_s, resolve_device(cfg.device))


@ray.remote
class ShardActor:
    """A rank 1..W-1 process. Its model outlives the groups it joins; the worker loop runs in a
    thread, so Ray methods (health, stats) stay responsive."""

    def __init__(self, cfg: ShardGroupConfig) -> None:
        self.cfg = cfg
        self.model = self.stats = self.thread = self.rank = self.error = None
        self.node_id = ray.get_runtime_context().get_node_id()

    def load(self, placement: Placement, rank: int) -> None:
        """Read this rank's weights before it joins (a new rank does this while the group serves)."""
        self.model = _load(self.cfg, placement, rank)
        self.stats = self.model.enable_stats()

    def join(self, rank: int, world_size: int, master: str, placement: Placement, max_num_seqs: int) -> dict:
        """Join the group formed at `master` as `rank`, once this rank's loop has seen its old group
        end, holding `placement`'s experts for that rank (reading only those it lacks)."""
        if self.thread is not None:
            self.thread.join(self.cfg.timeout_s)
            if self.thread.is_alive():
                raise RuntimeError(f"rank {self.rank} is still in the old group after {self.cfg.timeout_s} s")
        if self.model is None:
            self.load(placement, rank)
        self.rank, self.error = rank, None
        _join(self.cfg, rank, world_size, master)
        worker = ShardWorker(self.model, rank, world_size, max_num_seqs, self.cfg.max_model_len, self.cfg.block_size,
                             self.cfg.compile)
        worker.place(placement)
        self.thread = threading.Thread(target=self._loop, args=(worker,), daemon=True)
        self.thread.start()
        return {"rank": rank, "experts": list(placement.rank_experts[rank]), "loaded_bytes": self.model.loaded_bytes,
                "node_id": self.node_id}

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
                "node_id": self.node_id, "pid": os.getpid()}

    def get_stats(self) -> dict | None:
        return self.stats.to_dict() if self.stats is not None else None


class ShardGroup:
    """Owns one expert-parallel group; `start()` returns rank 0's runner for the engine. `base` is
    the placement without second homes, `placement` what the ranks hold."""

    def __init__(self, cfg: ShardGroupConfig, placement: Placement | None = None) -> None:
        from model_shards.config import ModelConfig

        self.cfg = cfg
        self.num_experts = ModelConfig.from_file(cfg.checkpoint).num_experts
        self.base = placement or contiguous_placement(self.num_experts, cfg.world_size)
        self.placement = self._homes(self.base)
        self.actors: list = []  # ranks 1.. in order
        self.bundles: list[int | None] = []  # each actor's bundle in `pg` (None: placed by node label)
        self.pg = self.model = self.runner = self.stats = None  # rank 0's model outlives re-forms
        self.shard_info: list[dict] = []
        self.generation = 0  # how many times the group was (re)formed
        self.width = cfg.world_size  # ranks now
        self.rank_failures_survived = self.resizes = 0
        self.last_recovery_s = 0.0  # the last re-form's pause: dead rank found to serving again
        self._joining: tuple | None = None  # a new rank loading its weights: (actor, bundle, load ref)

    def _homes(self, base: Placement) -> Placement:
        """`base` with a second home for every expert when the config asks for redundancy."""
        return with_second_homes(base) if self.cfg.redundancy and base.world_size > 1 else base

    def start(self) -> ShardedRunner:
        cfg, world = self.cfg, self.cfg.world_size
        if self.base.world_size != world:  # after a resize: the configured width again
            self.base = contiguous_placement(self.num_experts, world)
        self.placement = self._homes(self.base)
        if world > 1:
            bundle = {"CPU": cfg.cpus_per_shard} | ({"GPU": cfg.gpus_per_shard} if cfg.gpus_per_shard else {})
            node = ray.get_runtime_context().get_node_id()
            # STRICT_SPREAD: else Ray may put another bundle on rank 0's node and leave rank 0's pending
            away = {NODE_ID_LABEL_KEY: f"!in({node})"} if cfg.strategy == "STRICT_SPREAD" else {}
            self.pg = placement_group([RANK0_BUNDLE] + [bundle] * (world - 1), strategy=cfg.strategy,
                                      bundle_label_selector=[{NODE_ID_LABEL_KEY: node}] + [away] * (world - 1))
            ray.get(self.pg.ready(), timeout=cfg.start_timeout_s)
            self.bundles = list(range(1, world))
            self.actors = [self._new_actor(b) for b in self.bundles]
        loads = [a.load.remote(self.placement, r) for r, a in enumerate(self.actors, 1)]
        self.model = _load(cfg, self.placement, 0)
        self.stats = self.model.enable_stats()
        ray.get(loads, timeout=cfg.start_timeout_s)
        runner = self._form(self.actors, self.placement)
        log.info("shard group %d formed: %s", self.generation, self.shard_info)
        return runner

    def _new_actor(self, bundle: int | None) -> Any:
        """A shard actor in `bundle` of the placement group, or (None) on a node `strategy` allows."""
        cfg = self.cfg
        if bundle is not None:
            where = {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)}
        elif cfg.strategy == "STRICT_SPREAD":  # a node no rank uses
            where = {"label_selector": {NODE_ID_LABEL_KEY: f"!in({', '.join(i['node_id'] for i in self.shard_info)})"}}
        elif cfg.strategy == "STRICT_PACK":
            where = {"label_selector": {NODE_ID_LABEL_KEY: ray.get_runtime_context().get_node_id()}}
        else:
            where = {}
        return ShardActor.options(num_cpus=cfg.cpus_per_shard, num_gpus=cfg.gpus_per_shard, max_concurrency=4,
                                  **where).remote(cfg)

    def _form(self, actors: list, placement: Placement) -> ShardedRunner:
        """Form the group of rank 0 and `actors` (ranks 1.., weights loaded) holding `placement`."""
        cfg, world = self.cfg, 1 + len(actors)
        per_rank = -(-cfg.max_num_seqs * cfg.world_size // world)  # the configured batch fits at any width
        master = f"{ray.util.get_node_ip_address()}:{free_port()}"
        joined = [a.join.remote(r, world, master, placement, per_rank) for r, a in enumerate(actors, 1)]
        self.runner = None
        _join(cfg, 0, world, master)
        runner = ShardedRunner(self.model, world, per_rank, cfg.max_model_len, cfg.block_size, cfg.prefix_caching,
                               cfg.compile)  # returns once every rank has joined
        runner.place(placement)
        own = {"rank": 0, "experts": list(placement.rank_experts[0]), "loaded_bytes": self.model.loaded_bytes,
               "node_id": ray.get_runtime_context().get_node_id()}
        self.shard_info = [own] + ray.get(joined, timeout=cfg.start_timeout_s)
        self.actors, self.placement, self.width, self.runner = actors, placement, world, runner
        self.generation += 1
        return runner

    def stop(self, graceful: bool = True) -> None:
        if self.runner is not None and graceful:
            try:
                self.runner.shutdown()
            except Exception:  # the group is already broken
                pass
        self.runner = None
        if dist.is_initialized():
            dist.destroy_process_group()
        self.cancel_growth()
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors, self.bundles = [], []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def restart(self, placement: Placement | None = None) -> ShardedRunner:
        """Tear the (possibly broken) group down and form a new one, optionally with a new placement."""
        self.stop(graceful=False)
        if placement is not None:
            self.base = placement
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
                alive.append(rank)
            except Exception:  # the actor (or its node) is gone, or stopped answering
                ray.kill(actor, no_restart=True)
        dead = set(range(1, self.width)) - set(alive)
        if not dead or self.runner is None:
            return self.restart(propose())
        try:
            self.bundles = [self.bundles[r - 1] for r in alive]
            self._form([self.actors[r - 1] for r in alive], without_ranks(self.placement, dead))
        except Exception:
            log.exception("re-forming the shard group without rank(s) %s failed; restarting it", sorted(dead))
            return self.restart(propose())
        self.base = without_ranks(self.base, dead)
        self.rank_failures_survived += len(dead)
        self.last_recovery_s = time.monotonic() - t0
        log.warning("shard group %d: rank(s) %s died; %d ranks serve on after %.2f s without a restart",
                    self.generation, sorted(dead), self.width, self.last_recovery_s)
        return self.runner

    def prepare_growth(self) -> bool:
        """Start a new rank loading its weights beside the serving group, in a free bundle of the
        placement group (a dead rank's) if there is one; True once it is loaded (`resize` may join it)."""
        if self._joining is None:
            bundle = min(set(range(1, self.pg.bundle_count if self.pg else 1)) - set(self.bundles), default=None)
            actor = self._new_actor(bundle)
            self._joining = (actor, bundle, actor.load.remote(self._homes(with_new_rank(self.base)), self.width))
        ref = self._joining[2]
        if not ray.wait([ref], timeout=0)[0]:
            return False
        try:
            ray.get(ref)
        except Exception:  # it died while loading: try another next time
            log.warning("a new shard rank failed to load", exc_info=True)
            self.cancel_growth()
            return False
        return True

    def cancel_growth(self) -> None:
        if self._joining is not None:
            ray.kill(self._joining[0], no_restart=True)
            self._joining = None

    def resize(self, width: int) -> ShardedRunner:
        """Between steps: one rank wider (the rank `prepare_growth` loaded joins) or narrower (the
        last rank leaves). The others keep their weights: they only drop experts when the group
        widens and read the leaving rank's when it narrows."""
        t0 = time.monotonic()
        if width == self.width + 1 and self._joining is not None:
            actor, bundle, _ = self._joining
            actors, base, self._joining = self.actors + [actor], with_new_rank(self.base), None
            self.bundles.append(bundle)
        elif width == self.width - 1 >= 1:
            actors, base = self.actors[:-1], without_ranks(self.base, {self.width - 1})
        else:
            raise ValueError(f"resize: from {self.width} ranks to {width}, one step at a time (growth prepared)")
        self.runner.shutdown()  # every rank's loop ends; the old group with it
        for leaving in self.actors[len(actors):]:
            ray.kill(leaving, no_restart=True)
        self.bundles = self.bundles[: len(actors)]
        self._form(actors, self._homes(base))
        self.base = base
        self.resizes += 1
        log.info("shard group %d: %d ranks after %.2f s", self.generation, self.width, time.monotonic() - t0)
        return self.runner

    def replace(self, placement: Placement) -> None:
        """Live re-placement: every rank moves to `placement` now (between two steps, on the
        engine core's thread); a later re-form keeps it."""
        self.runner.replace(placement)
        self.base = self.placement = placement
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
