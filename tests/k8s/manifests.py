"""Load the manifests in k8s/ as objects: the base and each overlay, built like `kustomize build`."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.k8s import kustomize_lite

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
VARIANTS = {"base": K8S / "base", **{name: K8S / "overlays" / name for name in ("dev-cpu", "prod-gpu", "multinode-gpu")}}
# The variants on GPU pods: each one's Serve config is the shared one plus its serve-overrides.yaml.
GPU_VARIANTS = ("prod-gpu", "multinode-gpu")
# The Kubernetes version whose schemas core objects are checked against (kubernetes-validate ships it).
K8S_VERSION = "1.32.0"


def kustomize_command() -> list[str] | None:
    """`kustomize build` or `kubectl kustomize`, whichever is installed; None if neither."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def build_with_kustomize(variant: str) -> list[dict[str, Any]]:
    cmd = kustomize_command()
    assert cmd is not None
    out = subprocess.run([*cmd, str(VARIANTS[variant])], check=True, capture_output=True, text=True, timeout=60)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def build(variant: str) -> list[dict[str, Any]]:
    """The variant's objects: from kustomize where installed, else from kustomize_lite (a fresh copy)."""
    return copy.deepcopy(_build(variant))


@functools.cache
def _build(variant: str) -> list[dict[str, Any]]:
    if kustomize_command() is not None:
        return build_with_kustomize(variant)
    return kustomize_lite.build(VARIANTS[variant])


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def pod_templates(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group name ("head" for the head group) -> that group's pod template."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        out[group["groupName"]] = group["template"]
    return out


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])
