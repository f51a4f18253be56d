"""Core objects validate with kubernetes-validate --strict; the PodMonitor (a CRD) by shape;
and the objects agree with each other: selectors match pod labels, named ports exist."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.k8s.manifests import K8S_VERSION, VARIANTS, build, one, pod_templates

# Labels KubeRay puts on the pods it creates, beside the template's own.
KUBERAY_HEAD_LABELS = {"ray.io/node-type": "head", "ray.io/serve": "true"}
KUBERAY_WORKER_LABELS = {"ray.io/node-type": "worker", "ray.io/serve": "true"}


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def as_pod_template(name: str, template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_service_is_valid(variant: str) -> None:
    validate(one(build(variant), "Service"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pod_templates_are_valid_core_pod_templates(variant: str) -> None:
    """The RayService's pod templates are core PodTemplateSpecs: check them against the
    Kubernetes schema too, independently of the CRD's copy of it."""
    for group, template in pod_templates(one(build(variant), "RayService")).items():
        validate(as_pod_template(f"moeserve-{group}", template))


def test_strict_validation_catches_a_misspelled_service_field() -> None:
    service = copy.deepcopy(one(build("base"), "Service"))
    service["spec"]["ports"][0]["targetPrt"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service)


def test_strict_validation_catches_a_misspelled_pod_field() -> None:
    template = copy.deepcopy(pod_templates(one(build("base"), "RayService"))["head"])
    template["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(as_pod_template("broken", template))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_service_reaches_the_head_ports(variant: str) -> None:
    """The Service selects the head pod (where the gateway replicas and so the gRPC server
    run) and its target ports are named ports of the head container."""
    objects = build(variant)
    service, head = one(objects, "Service"), pod_templates(one(objects, "RayService"))["head"]
    pod_labels = {**head["metadata"]["labels"], **KUBERAY_HEAD_LABELS}
    assert service["spec"]["selector"].items() <= pod_labels.items()
    named_ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    for port in service["spec"]["ports"]:
        assert named_ports[port["targetPort"]] == port["port"], port
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 9000}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_podmonitor_shape_and_targets(variant: str) -> None:
    """Prometheus Operator's PodMonitor: a CRD, so no kubernetes-validate schema; check the
    fields the operator requires and that each endpoint names a port the pods have."""
    objects = build(variant)
    monitor, templates = one(objects, "PodMonitor"), pod_templates(one(objects, "RayService"))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) <= {"apiVersion", "kind", "metadata", "spec"}
    assert monitor["metadata"]["name"]
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels",
                         "sampleLimit"}
    selected = [t for t in templates.values() if spec["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items()]
    assert len(selected) == len(templates), "the PodMonitor must select every Ray pod"
    endpoint_keys = {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings", "scheme"}
    paths = set()
    for endpoint in spec["podMetricsEndpoints"]:
        assert set(endpoint) <= endpoint_keys, endpoint
        assert endpoint["path"].startswith("/")
        pods_with_port = [t for t in selected if endpoint["port"] in {p["name"] for p in t["spec"]["containers"][0]["ports"]}]
        assert pods_with_port, f"no selected pod has a port named {endpoint['port']!r}"
        for relabel in endpoint.get("relabelings", []):
            assert relabel.get("action", "replace") in {"replace", "keep", "drop", "labelmap"}
            assert all(label.startswith("__meta_kubernetes_pod_") for label in relabel.get("sourceLabels", []))
        paths.add((endpoint["port"], endpoint["path"]))
    # Ray's exporter on every pod and the gateway's own /metrics through the Serve port.
    assert ("metrics", "/metrics") in paths and ("serve", "/metrics") in paths


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_ray_container_declares_the_metrics_port(variant: str) -> None:
    for group, template in pod_templates(one(build(variant), "RayService")).items():
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports.get("metrics") == 8080 and ports.get("serve") == 8000, group
