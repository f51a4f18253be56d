"""The router-service actor: expert-load statistics from every shard group, and placement plans.

Engine replicas push their groups' cumulative counters every few seconds (never per step); the
actor keeps the latest per (replica, rank), merges them, and proposes an EPLB-style placement (and,
with `shards.live_replacement`, a `plan` to move a running group's experts).
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from router_service.gating import ExpertLoadStats
from router_service.placement import Placement, balanced_placement, contiguous_placement

log = logging.getLogger(__name__)


class RouterService:
    """Plain class (testable without Ray); `RouterServiceActor` is its Ray actor form."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._latest: dict[tuple[str, int], dict] = {}

    def report(self, source: str, rank_stats: list[dict]) -> None:
        """The latest cumulative counters of `source`'s ranks. Counters of another shape mean a
        different model is being served now: what was kept for the old one is dropped."""
        for rank, stats in enumerate(rank_stats):
            shape = (int(stats["num_layers"]), int(stats["num_experts"]))
            if shape != (self.num_layers, self.num_experts):
                self.num_layers, self.num_experts = shape
                self._latest.clear()
            self._latest[(source, rank)] = stats

    def merged(self) -> ExpertLoadStats:
        total = ExpertLoadStats(self.num_layers, self.num_experts)
        for stats in self._latest.values():
            total.merge(ExpertLoadStats.from_dict(stats))
        return total

    def summary(self) -> dict:
        merged = self.merged()
        return {"sources": sorted({s for s, _ in self._latest}), "layers": merged.summary(),
                "counters": merged.to_dict()}

    def placement(self, world_size: int, slots_per_rank: int | None = None) -> Placement:
        """Balanced placement from observed load (contiguous until there is any)."""
        load = self.merged().route_counts  # [L, E]
        if int(load.sum()) == 0:
            return contiguous_placement(self.num_experts, world_size)
        slots = slots_per_rank or -(-self.num_experts // world_size)
        return balanced_placement(load, world_size, slots)

    def plan(self, world_size: int, current: Placement) -> dict:
        """The proposed placement, and the busiest rank's load over the mean under `current`
        and under it: `gain` is the fraction of the busiest rank's load the move takes off."""
        load = self.merged().route_counts.sum(dim=0)  # [E]
        proposed = self.placement(world_size)
        total = float(load.sum())
        if total == 0 or current.num_experts != load.numel():
            return {"placement": proposed, "imbalance_now": 1.0, "imbalance_proposed": 1.0, "gain": 0.0}
        now, then = (float(p.rank_load(load).max()) * world_size / total for p in (current, proposed))
        return {"placement": proposed, "imbalance_now": now, "imbalance_proposed": then, "gain": 1.0 - then / now}


RouterServiceActor = ray.remote(num_cpus=0)(RouterService)
ROUTER_ACTOR_NAME = "moeserve-router-service"
ROUTER_NAMESPACE = "moeserve"  # explicit: engine and gateway replicas must find the same actor


def router_actor(num_layers: int, num_experts: int):
    """The cluster's one router-service actor, created by the first engine replica that reports.
    Detached: an actor owned by one autoscaled replica would die with it. It lives until the Ray
    cluster ends or `ray.kill`; a redeploy with another model resets its counters."""
    options = dict(name=ROUTER_ACTOR_NAME, namespace=ROUTER_NAMESPACE, get_if_exists=True, lifetime="detached")
    return RouterServiceActor.options(**options).remote(num_layers, num_experts)


def find_router_actor():
    """The router-service actor, or None while no engine has reported yet."""
    try:
        return ray.get_actor(ROUTER_ACTOR_NAME, namespace=ROUTER_NAMESPACE)
    except ValueError:
        return None


def proposed_placement(world_size: int, timeout_s: float = 5.0) -> Placement | None:
    """The placement the router service proposes for a group of `world_size` ranks, from the
    load seen so far; None without a router-service actor (or when it does not answer)."""
    try:
        actor = find_router_actor()
        return None if actor is None else ray.get(actor.placement.remote(world_size), timeout=timeout_s)
    except Exception:  # statistics must never keep a group from forming
        return None


def report_expert_load(server: Any) -> None:
    """An engine replica's (`EngineServer`) reporting thread: its counters to the router-service actor
    every few seconds (never per step), and with `shards.live_replacement` its group's re-placement."""
    import time

    from model_shards.config import ModelConfig
    from moeserve.config import resolve_path

    cfg = ModelConfig.from_file(resolve_path(server.config.model.path))
    router, last, every = None, None, server.config.engine.expert_load_report_s
    while not server.stopping and server.core.dead is None:
        time.sleep(every)
        if server.stopping or not ray.is_initialized():  # never start a Ray of our own (a call would)
            return
        try:
            if last is not None:
                ray.get(last, timeout=every)  # raises if the actor died
            router = router or router_actor(cfg.num_layers, cfg.num_experts)
            last = router.report.remote(f"engine-{id(server):x}", server.expert_load())
            if server.config.shards.live_replacement and server.shard_group is not None:
                _maybe_replace(server, router)
        except Exception as e:  # statistics must never disturb serving
            if isinstance(e, ray.exceptions.RayActorError):
                router = None  # gone (killed): find or create it again next time
            last = None
            log.warning("could not report expert load", exc_info=True)


def _maybe_replace(server: Any, router: Any) -> None:
    """Ask the router service for a plan; send it to the core if it pays (live re-placement)."""
    from moeserve.protocol import ApplyPlacement

    group, wait = server.shard_group, server.config.engine.expert_load_report_s
    plan = ray.get(router.plan.remote(group.cfg.world_size, group.placement), timeout=wait)
    if plan["gain"] >= server.config.shards.replacement_min_gain and plan["placement"] != group.placement:
        log.info("re-placing experts: busiest rank %.2f -> %.2f of the mean", plan["imbalance_now"],
                 plan["imbalance_proposed"])
        server.core.send(ApplyPlacement(plan["placement"].rank_experts))
