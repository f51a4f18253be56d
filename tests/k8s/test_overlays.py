"""The overlays build, and say what they claim: dev-cpu is one small CPU worker, prod-gpu
and multinode-gpu have GPU pods on GPU nodes (multinode-gpu: one GPU per pod). Where kubectl or kustomize is installed, the built-in
kustomize_lite must produce exactly what kustomize does (so the tests mean the same
on machines without it)."""

from __future__ import annotations

import pytest

from tests.k8s import kustomize_lite
from tests.k8s.manifests import (
    GPU_VARIANTS,
    VARIANTS,
    build,
    build_with_kustomize,
    kustomize_command,
    one,
    pod_templates,
)


def by_key(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.mark.skipif(kustomize_command() is None, reason="neither kustomize nor kubectl is installed")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kustomize_lite_agrees_with_kustomize(variant: str) -> None:
    assert by_key(kustomize_lite.build(VARIANTS[variant])) == by_key(build_with_kustomize(variant))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_of_each_object(variant: str) -> None:
    kinds = sorted(o["kind"] for o in build(variant))
    assert kinds == ["PodMonitor", "RayService", "Service"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_images_are_placeholders_the_user_overrides(variant: str) -> None:
    """No registry host in the repository: the image is `moeserve:<tag>`, set per overlay."""
    rayservice = one(build(variant), "RayService")
    images = [c["image"] for t in pod_templates(rayservice).values() for c in t["spec"]["containers"]]
    assert images and all(i.split(":")[0] == "moeserve" for i in images), images
    assert "image" not in rayservice["spec"]["rayClusterConfig"]["autoscalerOptions"]  # defaults to the head's


def test_dev_cpu_is_one_small_cpu_worker() -> None:
    cluster = one(build("dev-cpu"), "RayService")["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert group["minReplicas"] == group["maxReplicas"] == group["replicas"] == 1
    for template in pod_templates({"spec": {"rayClusterConfig": cluster}}).values():
        limits = template["spec"]["containers"][0]["resources"]["limits"]
        assert not any(key.endswith("/gpu") for key in limits)


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_gpu_workers_are_gpu_pods_on_gpu_nodes(variant: str) -> None:
    objects = build(variant)
    cluster = one(objects, "RayService")["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    spec = group["template"]["spec"]
    resources = spec["containers"][0]["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert group["maxReplicas"] > group["minReplicas"] >= 1
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in head["containers"][0]["resources"]["limits"]
    assert "tolerations" not in head  # the head stays off tainted GPU nodes
    # Both the gateway (tokenizer) and the engine read the model volume.
    for pod in (head, spec):
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert "/models" in mounts


def test_multinode_gpu_pods_hold_one_gpu_each() -> None:
    """One GPU per worker pod: a spread shard group's ranks are separate pods (the capacity
    rules in test_capacity.py check that the Serve config spreads them)."""
    (group,) = one(build("multinode-gpu"), "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == 1


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "base"])
def test_overlays_label_their_objects(variant: str) -> None:
    for obj in build(variant):
        assert obj["metadata"]["labels"]["moeserve.io/variant"] == variant


# --- kustomize_lite itself --------------------------------------------------------------


def test_json_patch_operations() -> None:
    doc = {"a": {"b": [1, 2, 3]}, "c": "x"}
    for op in [
        {"op": "replace", "path": "/a/b/1", "value": 20},
        {"op": "add", "path": "/a/b/-", "value": 4},
        {"op": "add", "path": "/a/b/0", "value": 0},
        {"op": "remove", "path": "/c"},
        {"op": "add", "path": "/d~1e", "value": {"f": 1}},
        {"op": "copy", "from": "/d~1e", "path": "/g"},
        {"op": "move", "from": "/g", "path": "/h"},
        {"op": "test", "path": "/h/f", "value": 1},
    ]:
        kustomize_lite.apply_op(doc, op)
    assert doc == {"a": {"b": [0, 1, 20, 3, 4]}, "d/e": {"f": 1}, "h": {"f": 1}}
    with pytest.raises(KeyError):
        kustomize_lite.apply_op(doc, {"op": "replace", "path": "/missing", "value": 1})


def test_image_rewrites() -> None:
    image = {"name": "moeserve", "newName": "my-registry/team/moeserve", "newTag": "v1"}
    assert kustomize_lite._rewrite("moeserve:latest", image) == "my-registry/team/moeserve:v1"
    assert kustomize_lite._rewrite("moeserve", image) == "my-registry/team/moeserve:v1"
    assert kustomize_lite._rewrite("other:latest", image) == "other:latest"
    assert kustomize_lite._rewrite("moeserve:x", {"name": "moeserve", "digest": "sha256:ab"}) == "moeserve@sha256:ab"
