"""The RayService validates against KubeRay's CRD schema, with unknown fields rejected."""

from __future__ import annotations

import copy

import pytest

from tests.k8s import schemas
from tests.k8s.manifests import VARIANTS, build, one

pytestmark = pytest.mark.skipif(not schemas.RAYSERVICE_CRD.exists(),
                                reason=f"KubeRay CRD not found at {schemas.RAYSERVICE_CRD}")


@pytest.fixture(scope="module")
def base_rayservice() -> dict:
    return one(build("base"), "RayService")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rayservice_is_valid(variant: str) -> None:
    rayservice = one(build(variant), "RayService")
    assert schemas.rayservice_errors(rayservice) == []


# Misspellings at several depths: the spec, a worker group, a container, a probe-free
# PodSpec field, and KubeRay's own options.
MISSPELLED = [
    (("spec",), "serveConfigV3"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0), "minReplica"),
    (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0), "imagePullPolicyy"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec"), "nodeSelecter"),
    (("spec", "rayClusterConfig", "autoscalerOptions"), "idleTimeoutSecond"),
    (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "resources"), "limit"),
]


@pytest.mark.parametrize(("path", "field"), MISSPELLED)
def test_a_misspelled_field_is_rejected(base_rayservice: dict, path: tuple, field: str) -> None:
    broken = copy.deepcopy(base_rayservice)
    node = broken
    for key in path:
        node = node[key]
    node[field] = {} if field in ("limit",) else 1
    errors = schemas.rayservice_errors(broken)
    assert any(field in e and "Additional properties" in e for e in errors), errors


def test_the_crd_schema_alone_would_accept_the_misspelling(base_rayservice: dict) -> None:
    """Why strict(): the CRD as published lets unknown fields through."""
    import jsonschema

    crd = schemas.load_crd()
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    broken = copy.deepcopy(base_rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    jsonschema.Draft7Validator(v1["schema"]["openAPIV3Schema"]).validate(broken)  # no error
    assert schemas.rayservice_errors(broken)


def test_wrong_types_and_enums_are_rejected(base_rayservice: dict) -> None:
    broken = copy.deepcopy(base_rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    broken["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Fast"
    errors = schemas.rayservice_errors(broken)
    assert any("maxReplicas" in e for e in errors) and any("upscalingMode" in e for e in errors), errors


def test_strict_keeps_maps_and_preserved_objects_open() -> None:
    schema = {
        "type": "object",
        "properties": {
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "raw": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
            # A property named like a keyword must be walked as a property, not a keyword.
            "type": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
    strict = schemas.strict(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in strict["properties"]["raw"]
    assert strict["properties"]["type"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is untouched
