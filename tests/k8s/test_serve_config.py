"""One source of truth: the RayService's serveConfigV2 is deployments/serve_config.yaml
(the GPU overlay: that file plus serve-overrides.yaml), every variant's Serve config is
valid for Ray Serve and for the app, and what it asks for fits in the pods the manifests
give it."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import pytest
import yaml

from moeserve.config import AppConfig, deep_merge
from tests.k8s.manifests import K8S, REPO, VARIANTS, build, one, pod_templates, serve_config

SERVE_CONFIG = REPO / "deployments" / "serve_config.yaml"
GPU_OVERRIDES = K8S / "overlays" / "prod-gpu" / "serve-overrides.yaml"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's built-in resource of the head node


def load_generator():
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load_generator()


def test_generated_files_are_up_to_date() -> None:
    assert generate.main(["--check"]) == 0, "run: python k8s/generate.py"


@pytest.mark.parametrize("variant", ["base", "dev-cpu"])
def test_serve_config_v2_is_the_cli_serve_config(variant: str) -> None:
    embedded = one(build(variant), "RayService")["spec"]["serveConfigV2"]
    assert yaml.safe_load(embedded) == yaml.safe_load(SERVE_CONFIG.read_text())
    assert embedded == SERVE_CONFIG.read_text()  # verbatim, comments included


def test_gpu_serve_config_is_the_cli_serve_config_plus_the_overrides() -> None:
    embedded = serve_config(one(build("prod-gpu"), "RayService"))
    base, overrides = yaml.safe_load(SERVE_CONFIG.read_text()), yaml.safe_load(GPU_OVERRIDES.read_text())
    assert embedded == generate.merge(base, overrides)
    # The overrides refine the shared application; they never add one of their own.
    assert {a["name"] for a in overrides["applications"]} <= {a["name"] for a in base["applications"]}
    assert embedded["applications"][0]["import_path"] == base["applications"][0]["import_path"]


def test_merge_rules() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "apps": [{"name": "x", "v": 1, "w": {"k": 1}}, {"name": "y"}]}
    over = {"a": {"c": [3]}, "apps": [{"name": "x", "w": {"j": 2}}, {"name": "z"}]}
    assert generate.merge(base, over) == {
        "a": {"b": 1, "c": [3]},
        "apps": [{"name": "x", "v": 1, "w": {"k": 1, "j": 2}}, {"name": "y"}, {"name": "z"}],
    }


def test_embedding_is_idempotent_and_keeps_the_rest_of_the_manifest() -> None:
    manifest = "a: 1\nspec:\n  serveConfigV2: |\n    old: 1\n\n    more: 2\n  next: 3\n"
    once = generate.embed_serve_config(manifest, "# c\nnew: 1\n\nx:\n  - 1\n")
    assert once == "a: 1\nspec:\n  serveConfigV2: |\n    # c\n    new: 1\n\n    x:\n      - 1\n  next: 3\n"
    assert generate.embed_serve_config(once, "# c\nnew: 1\n\nx:\n  - 1\n") == once
    assert yaml.safe_load(once)["spec"]["serveConfigV2"] == "# c\nnew: 1\n\nx:\n  - 1\n"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_serve_config_is_valid_for_ray_serve(variant: str) -> None:
    from ray.serve.schema import ServeDeploySchema  # schema only; starts nothing

    ServeDeploySchema.model_validate(serve_config(one(build(variant), "RayService")))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_serve_config_args_are_valid_for_the_app(variant: str) -> None:
    args = serve_config(one(build(variant), "RayService"))["applications"][0]["args"]
    AppConfig.from_dict(args)  # raises a ValidationError naming any field the app does not accept


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ports_agree(variant: str) -> None:
    objects = build(variant)
    config = serve_config(one(objects, "RayService"))
    service_ports = {p["name"]: p["port"] for p in one(objects, "Service")["spec"]["ports"]}
    assert config["http_options"] == {"host": "0.0.0.0", "port": service_ports["http"]}
    assert config["proxy_location"] == "EveryNode"  # every pod's proxy can take HTTP
    args = config["applications"][0]["args"]
    grpc_port = args.get("gateway", {}).get("grpc_port", AppConfig().gateway.grpc_port)
    assert grpc_port == service_ports["grpc"]


def test_grpc_service_reaches_a_gateway() -> None:
    """gRPC is served by the gateway replicas themselves, so the Service's port 9000
    reaches a gateway only where one runs: the Service selects the head, so the Serve
    config must pin the gateway there (Ray's `node:__internal_head__` resource, which a
    local single-node Ray has too)."""
    for variant in VARIANTS:
        assert plan(variant).gateway.pinned_to_head, variant


# --- capacity: what Serve asks for fits in the pods ------------------------------------


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
    engine_replica_cpus: float  # the engine plus its shard actors (one pod: they are packed)
    engine_replica_gpus: float
    head_cpus: float
    worker_cpus: float
    worker_gpus: float
    worker_min: int
    worker_max: int
    worker_cpu_limit: float
    head_cpu_limit: float


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
    rayservice = one(build(variant), "RayService")
    app = serve_config(rayservice)["applications"][0]
    args = deep_merge(AppConfig().model_dump(), app.get("args") or {})  # defaults + given, unvalidated
    serve_level = {d["name"]: d for d in app.get("deployments") or []}
    gateway = _demand(args["deployments"]["gateway"], serve_level.get("gateway", {}))
    engine = _demand(args["deployments"]["engine"], serve_level.get("engine", {}))
    shards = args["shards"]
    others = shards["num_shards"] - 1  # rank 0 runs in the engine replica's own process
    cluster = rayservice["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    head_limits = pod_templates(rayservice)["head"]["spec"]["containers"][0]["resources"]["limits"]
    return Plan(
        gateway=gateway, engine=engine,
        engine_replica_cpus=engine.num_cpus + others * shards.get("cpus_per_shard", 1.0),
        engine_replica_gpus=engine.num_gpus + others * shards.get("gpus_per_shard", 0.0),
        head_cpus=float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"]),
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


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_engine_never_fits_on_the_head(variant: str) -> None:
    """With the gateway's minimum replicas on the head, the rest of the head is too small
    for an engine replica, so engines always go to worker pods."""
    p = plan(variant)
    assert p.head_cpus - p.gateway.min_replicas * p.gateway.num_cpus < p.engine.num_cpus


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_replicas_fit_in_the_worker_group(variant: str) -> None:
    p = plan(variant)
    assert p.engine_replica_cpus <= p.worker_cpus, "one engine replica (with its shard actors) must fit in one pod"
    per_pod = math.floor(p.worker_cpus / p.engine_replica_cpus)
    if p.engine_replica_gpus:
        per_pod = min(per_pod, math.floor(p.worker_gpus / p.engine_replica_gpus))
    assert per_pod >= 1
    assert p.engine.max_replicas <= p.worker_max * per_pod, "Serve could ask for replicas no pod can take"
    assert p.engine.min_replicas <= p.worker_min * per_pod or p.worker_max > p.worker_min


def test_gpu_pods_hold_exactly_one_shard_group() -> None:
    p = plan("prod-gpu")
    assert p.engine_replica_gpus == p.worker_gpus, "GPUs per pod must equal ranks per engine replica"
    assert p.engine.max_replicas == p.worker_max, "each GPU pod the autoscaler may add is one engine replica"


@pytest.mark.parametrize("variant", ["base", "dev-cpu"])
def test_cpu_variants_serve_the_demo_models_baked_into_the_image(variant: str) -> None:
    args = serve_config(one(build(variant), "RayService"))["applications"][0]["args"]
    paths = [args["model"]["path"]]
    if args.get("speculative", {}).get("draft") == "model":
        paths.append(args["speculative"].get("draft_path") or AppConfig().speculative.draft_path)
    for path in paths:
        assert path.startswith("checkpoints/"), "relative to /app, where the Dockerfile copies checkpoints/"


def test_gpu_variant_reads_models_from_the_mounted_volume() -> None:
    rayservice = one(build("prod-gpu"), "RayService")
    args = serve_config(rayservice)["applications"][0]["args"]
    for template in pod_templates(rayservice).values():
        mounts = [m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]]
        for path in (args["model"]["path"], args["speculative"]["draft_path"]):
            assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), path
