"""One source of truth: the RayService's serveConfigV2 is deployments/serve_config.yaml
(a GPU overlay: that file plus its serve-overrides.yaml), and every variant's Serve config
is valid for Ray Serve and for the app. What it asks for fits in the pods: test_capacity.py."""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from moeserve.config import AppConfig
from tests.k8s.manifests import GPU_VARIANTS, K8S, REPO, VARIANTS, build, one, pod_templates, serve_config

SERVE_CONFIG = REPO / "deployments" / "serve_config.yaml"


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


def test_every_gpu_overlay_is_generated() -> None:
    """An overlay with serve-overrides.yaml is one the generator writes, and its kustomization
    applies the generated patch."""
    with_overrides = {p.parent.name for p in (K8S / "overlays").glob("*/serve-overrides.yaml")}
    assert with_overrides == set(generate.GPU_OVERLAYS) == set(GPU_VARIANTS)
    for variant in GPU_VARIANTS:
        kustomization = yaml.safe_load((K8S / "overlays" / variant / "kustomization.yaml").read_text())
        assert "serve-config.patch.yaml" in [patch["path"] for patch in kustomization["patches"]], variant


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_gpu_serve_config_is_the_cli_serve_config_plus_the_overrides(variant: str) -> None:
    embedded = serve_config(one(build(variant), "RayService"))
    overrides_file = K8S / "overlays" / variant / "serve-overrides.yaml"
    base, overrides = yaml.safe_load(SERVE_CONFIG.read_text()), yaml.safe_load(overrides_file.read_text())
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


@pytest.mark.parametrize("variant", ["base", "dev-cpu"])
def test_cpu_variants_serve_the_demo_models_baked_into_the_image(variant: str) -> None:
    args = serve_config(one(build(variant), "RayService"))["applications"][0]["args"]
    paths = [args["model"]["path"]]
    if args.get("speculative", {}).get("draft") == "model":
        paths.append(args["speculative"].get("draft_path") or AppConfig().speculative.draft_path)
    for path in paths:
        assert path.startswith("checkpoints/"), "relative to /app, where the Dockerfile copies checkpoints/"


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_gpu_variant_reads_models_from_the_mounted_volume(variant: str) -> None:
    rayservice = one(build(variant), "RayService")
    args = serve_config(rayservice)["applications"][0]["args"]
    for template in pod_templates(rayservice).values():
        mounts = [m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]]
        for path in (args["model"]["path"], args["speculative"]["draft_path"]):
            assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), path
