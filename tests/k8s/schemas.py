"""Offline validators for the manifests in k8s/: the KubeRay CRD schema, made strict.

A CRD's openAPIV3Schema lets unknown fields through (the API server prunes them
silently), so a misspelled field such as `minReplica` would pass. `strict()` closes every
object schema that lists its `properties` and does not opt into
`x-kubernetes-preserve-unknown-fields`, which is what the API server's own pruning and
`kubectl --validate=strict` do to a manifest.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO.parent / "shared" / "k8s-schemas"
RAYSERVICE_CRD = SCHEMAS / "ray.io_rayservices.yaml"

# Keywords whose value is a schema, or a list or map of schemas. Everything else (enum,
# required, default, x-kubernetes-*) is data and must not be walked: a property may well
# be named "type" or "default".
_SCHEMA_VALUED = ("items", "additionalProperties", "not")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` in which objects with declared properties reject any other key."""
    out = copy.deepcopy(schema)
    _close(out)
    return out


def _close(node: dict[str, Any]) -> None:
    props = node.get("properties")
    if isinstance(props, dict):
        for sub in props.values():
            _close(sub)
        if not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
            node["additionalProperties"] = False
    for key in _SCHEMA_VALUED:
        if isinstance(node.get(key), dict):
            _close(node[key])
    for key in _SCHEMA_LISTS:
        for sub in node.get(key) or []:
            _close(sub)


@functools.cache
def load_crd() -> dict[str, Any]:
    """The RayService CRD (1 MB of YAML: the C loader when PyYAML has it, ~5x faster)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(RAYSERVICE_CRD.read_text(), Loader=loader)


@functools.cache
def rayservice_schema(version: str = "v1") -> dict[str, Any]:
    """The RayService CRD's openAPIV3Schema for `version`, strict."""
    crd = load_crd()
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strict(found["schema"]["openAPIV3Schema"])


def rayservice_errors(obj: dict[str, Any]) -> list[str]:
    """Every schema violation in a RayService manifest, as 'path: message' lines."""
    version = obj.get("apiVersion", "").rpartition("/")[2]
    validator = jsonschema.Draft7Validator(rayservice_schema(version))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]
