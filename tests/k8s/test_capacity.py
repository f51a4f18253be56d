"""What each variant's Serve config asks for fits in the pods its manifests give it: the
gateways on the head, the engine replicas (with their shard groups, packed into one pod or
spread one rank per pod) on the worker group, and nothing of an engine on the head."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import pytest
import yaml

from deployments.shard_group import RANK0_BUNDLE, ShardGroupConfig
from moeserve.config import AppConfig, deep_merge
from tests.k8s.manifests import GPU_VARIANTS, VARIANTS, build, one, pod_templates, serve_config

HEAD_RESOURCE = "node:__internal_head__"  # Ray's built-in resource of the head node
CPUS_PER_SHARD = {f.name: f.default for f in dataclasses.fields(ShardGroupConfig)}["cpus_per_shard"]

# An engine replica with `shards.num_shards` W > 1 forms a shard group (deployments/shard_group.py):
# rank 0 is the replica itself (its num_cpus / num_gpus, plus a token placement-group bundle
# pinned to its node), ranks 1..W-1 are shard actors of cpus_per_shard + gpus_per_shard each.
# `shards.strategy` places them: STRICT_SPREAD every rank on a Ray node (a pod) of its own,
# otherwise (STRICT_PACK, PACK) the whole group in the replica's pod.


@dataclass(frozen=True)
class Demand:
    min_replicas: int
    max_replicas: int
    num_cpus: float
    num_gpus: float
    pinned_to_head: bool


@dataclass(frozen=True)
class Plan:
    gateway: Demand
    engine: Demand
    ranks: int  # of an engine replica's shard group, rank 0 (the replica) included; 1: no group
    spread: bool  # every rank in a pod of its own
    shard_cpus: float  # each of ranks 1..W-1
    shard_gpus: float
    head_cpus: float
    head_gpus: float
    worker_cpus: float
    worker_gpus: float
    worker_min: int
    worker_max: int
    worker_cpu_limit: float
    head_cpu_limit: float

    @property
    def rank0_cpus(self) -> float:
        """The engine replica and, with a group, rank 0's bundle on its node."""
        return self.engine.num_cpus + (RANK0_BUNDLE["CPU"] if self.ranks > 1 else 0.0)

    @property
    def pods_per_replica(self) -> int:
        return self.ranks if self.spread else 1

    @property
    def pod_demands(self) -> list[tuple[float, float]]:
        """(CPUs, GPUs) each pod of one engine replica must hold."""
        if self.spread:
            return [(self.rank0_cpus, self.engine.num_gpus)] + [(self.shard_cpus, self.shard_gpus)] * (self.ranks - 1)
        others = self.ranks - 1
        return [(self.rank0_cpus + others * self.shard_cpus, self.engine.num_gpus + others * self.shard_gpus)]


def _demand(section: dict, serve_level: dict) -> Demand:
    scaling = section.get("autoscaling")
    lo = hi = section.get("num_replicas") or 1
    if scaling:
        lo, hi = scaling.get("min_replicas", 1), scaling.get("max_replicas", 1)
    actor = {"num_cpus": section.get("num_cpus", 1.0), "num_gpus": section.get("num_gpus", 0),
             "resources": section.get("resources", {})}
    actor.update(serve_level.get("ray_actor_options", {}))  # Serve-level options win
    if "autoscaling_config" in serve_level:
        lo, hi = serve_level["autoscaling_config"]["min_replicas"], serve_level["autoscaling_config"]["max_replicas"]
    return Demand(lo, hi, actor["num_cpus"], actor["num_gpus"], HEAD_RESOURCE in (actor.get("resources") or {}))


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def plan(variant: str) -> Plan:
    return plan_of(one(build(variant), "RayService"))


def plan_of(rayservice: dict) -> Plan:
    app = serve_config(rayservice)["applications"][0]
    args = deep_merge(AppConfig().model_dump(), app.get("args") or {})  # defaults + given, unvalidated
    serve_level = {d["name"]: d for d in app.get("deployments") or []}
    shards = args["shards"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    head_limits = pod_templates(rayservice)["head"]["spec"]["containers"][0]["resources"]["limits"]
    return Plan(
        gateway=_demand(args["deployments"]["gateway"], serve_level.get("gateway", {})),
        engine=_demand(args["deployments"]["engine"], serve_level.get("engine", {})),
        ranks=shards["num_shards"], spread=shards["strategy"] == "STRICT_SPREAD",
        shard_cpus=CPUS_PER_SHARD, shard_gpus=shards["gpus_per_shard"],
        head_cpus=float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"]),
        head_gpus=float(head_limits.get("nvidia.com/gpu", 0)),
        worker_cpus=float(workers["rayStartParams"]["num-cpus"]),
        worker_gpus=float(limits.get("nvidia.com/gpu", 0)),
        worker_min=workers["minReplicas"], worker_max=workers["maxReplicas"],
        worker_cpu_limit=_cpus(limits["cpu"]), head_cpu_limit=_cpus(head_limits["cpu"]),
    )  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ray_never_schedules_more_cpus_than_the_pod_has(variant: str) -> None:
    p = plan(variant)
    assert p.head_cpus < p.head_cpu_limit  # a core is left for GCS, dashboard, controller, proxy
    assert p.worker_cpus <= p.worker_cpu_limit


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_all_gateway_replicas_fit_on_the_head(variant: str) -> None:
    p = plan(variant)
    assert p.gateway.max_replicas * p.gateway.num_cpus <= p.head_cpus
    assert p.gateway.num_gpus == 0


def engine_free_head_errors(p: Plan) -> list[str]:
    """With the gateway's minimum replicas on the head, what is left of it is too small for an
    engine replica and for a shard actor, so both always go to worker pods."""
    free = p.head_cpus - p.gateway.min_replicas * p.gateway.num_cpus
    demands = {"an engine replica": (p.engine.num_cpus, p.engine.num_gpus)}
    if p.ranks > 1:
        demands["a shard actor"] = (p.shard_cpus, p.shard_gpus)
    return [f"{what} fits on the head" for what, (cpus, gpus) in demands.items()
            if cpus <= free and gpus <= p.head_gpus]


def _fits(cpus: float, gpus: float, pod_cpus: float, pod_gpus: float) -> int | None:
    """How many (cpus, gpus) demands fit in a pod (None: any number, the demand is empty)."""
    counts = [math.floor(have / need) for need, have in ((cpus, pod_cpus), (gpus, pod_gpus)) if need]
    return min(counts) if counts else None


def worker_group_errors(p: Plan) -> list[str]:
    """What in the worker group cannot take the engine replicas Serve may ask for: a pod too
    small for its part of a replica (the whole group packed, or one rank spread), or too few
    pods (a spread group takes one pod per rank)."""
    fits = [_fits(cpus, gpus, p.worker_cpus, p.worker_gpus) for cpus, gpus in p.pod_demands]
    errors = [f"a pod ({p.worker_cpus} CPUs, {p.worker_gpus} GPUs) cannot hold {cpus} CPUs and {gpus} GPUs"
              for (cpus, gpus), n in zip(p.pod_demands, fits) if n == 0]
    if errors:
        return errors
    per_pod = min([n for n in fits if n is not None], default=1)  # spread: ranks (of other groups too) per pod

    def pods_for(replicas: int) -> int:
        return math.ceil(replicas * p.ranks / per_pod) if p.spread else math.ceil(replicas / per_pod)

    if pods_for(p.engine.max_replicas) > p.worker_max:
        errors.append(f"Serve may ask for {p.engine.max_replicas} engine replicas, which take "
                      f"{pods_for(p.engine.max_replicas)} pods; the worker group has at most {p.worker_max} pods")
    if pods_for(p.engine.min_replicas) > p.worker_min and p.worker_max == p.worker_min:
        errors.append("the minimum engine replicas take more than the minimum pods, and no pod can be added")
    return errors


def gpu_layout_errors(p: Plan) -> list[str]:
    """A GPU pod holds exactly what one engine replica puts on it: the whole group (packed)
    or one rank (spread); every pod the autoscaler may add serves, and rank 0 (the replica
    itself) has a GPU like every other rank."""
    errors = []
    if p.engine.num_gpus != p.shard_gpus and p.ranks > 1:
        errors.append(f"rank 0 (the engine replica) has {p.engine.num_gpus} GPUs, each shard {p.shard_gpus}")
    if p.spread:
        if p.worker_gpus != p.shard_gpus:
            errors.append(f"GPUs per pod ({p.worker_gpus}) must equal one rank's ({p.shard_gpus})")
    elif p.worker_gpus != p.engine.num_gpus + (p.ranks - 1) * p.shard_gpus:
        errors.append(f"GPUs per pod ({p.worker_gpus}) must equal one engine replica's group's")
    if p.engine.max_replicas * p.pods_per_replica != p.worker_max:
        errors.append(f"the GPU pods' maxReplicas ({p.worker_max}) must be engine replicas x pods per replica "
                      f"({p.engine.max_replicas} x {p.pods_per_replica})")
    return errors


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_engine_never_fits_on_the_head(variant: str) -> None:
    assert engine_free_head_errors(plan(variant)) == []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_replicas_fit_in_the_worker_group(variant: str) -> None:
    assert worker_group_errors(plan(variant)) == []


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_gpu_pods_hold_exactly_one_shard_group(variant: str) -> None:
    assert gpu_layout_errors(plan(variant)) == []


def test_multinode_gpu_spreads_its_group_one_rank_per_pod() -> None:
    p = plan("multinode-gpu")
    assert p.spread and p.ranks > 1 and p.pods_per_replica == p.ranks
    assert p.worker_gpus == p.shard_gpus == p.engine.num_gpus == 1
    assert p.worker_min >= p.ranks * p.engine.min_replicas  # the first group forms without waiting for pods


def _with(rayservice: dict, shards: dict | None = None, engine: dict | None = None,
          autoscaling: dict | None = None, workers: dict | None = None) -> dict:
    """A copy of `rayservice` with Serve args (shards, the engine deployment and its autoscaling)
    and worker-group fields ("gpus": the pods' nvidia.com/gpu) changed."""
    out = copy.deepcopy(rayservice)
    config = serve_config(out)
    args = config["applications"][0]["args"]
    args["shards"].update(shards or {})
    args["deployments"]["engine"].update(engine or {})
    args["deployments"]["engine"]["autoscaling"].update(autoscaling or {})
    out["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    group = out["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    for key, value in (workers or {}).items():
        if key == "gpus":
            for side in ("requests", "limits"):
                group["template"]["spec"]["containers"][0]["resources"][side]["nvidia.com/gpu"] = value
        else:
            group[key] = value
    return out


RULES = {"worker group": worker_group_errors, "gpu layout": gpu_layout_errors, "head": engine_free_head_errors}


@pytest.mark.parametrize(("change", "rule"), [
    ({"workers": {"maxReplicas": 7}}, "worker group"),  # 2 replicas x 4 ranks take 8 pods
    ({"autoscaling": {"max_replicas": 3}}, "worker group"),  # Serve asks for more groups than pods
    ({"shards": {"num_shards": 5}}, "worker group"),  # a fifth rank per group
    ({"workers": {"gpus": 2}}, "gpu layout"),  # a rank per pod leaves a GPU idle
    ({"workers": {"gpus": 0}}, "worker group"),  # no GPU for any rank
    ({"shards": {"gpus_per_shard": 2}}, "worker group"),  # a rank's GPUs do not fit a one-GPU pod
    ({"engine": {"num_gpus": 0}}, "gpu layout"),  # rank 0 without a GPU
    ({"engine": {"num_cpus": 8.0}}, "worker group"),  # the replica and rank 0's bundle over the pod's CPUs
    ({"shards": {"strategy": "STRICT_PACK"}}, "worker group"),  # a packed group of 4 GPUs in a one-GPU pod
])
def test_the_capacity_rules_catch_a_multinode_number_that_disagrees(change: dict, rule: str) -> None:
    """Each rule fails when one number of the multinode overlay changes alone."""
    rayservice = one(build("multinode-gpu"), "RayService")
    assert not any(check(plan_of(rayservice)) for check in RULES.values())
    assert RULES[rule](plan_of(_with(rayservice, **change))), change


def test_a_shard_actor_on_a_cpu_head_is_caught() -> None:
    """A CPU-only spread group (no GPUs asked for) would put shard actors on the head if it had room."""
    rayservice = _with(one(build("multinode-gpu"), "RayService"), shards={"gpus_per_shard": 0, "num_shards": 2},
                       engine={"num_gpus": 0})
    assert engine_free_head_errors(plan_of(rayservice)) == ["a shard actor fits on the head"]


def test_grpc_service_reaches_a_gateway() -> None:
    """gRPC is served by the gateway replicas themselves, so the Service's port 9000
    reaches a gateway only where one runs: the Service selects the head, so the Serve
    config must pin the gateway there (Ray's `node:__internal_head__` resource, which a
    local single-node Ray has too)."""
    for variant in VARIANTS:
        assert plan(variant).gateway.pinned_to_head, variant
