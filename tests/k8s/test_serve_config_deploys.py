"""The serveConfigV2 embedded in the RayService deploys on a local Ray and answers.

What KubeRay does with it, minus Kubernetes: import the application's `import_path`, build
it from its `args`, run it under its name and route prefix. Changed for a shared test
machine only: the listen addresses (free loopback ports instead of 0.0.0.0:8000 and :9000)
and, until the demo checkpoints exist, the model folder (a tiny random MoE instead).
One Ray instance, one /health and one completion, then shut down.
"""

from __future__ import annotations

import importlib
import os
import socket
import time

import httpx
import pytest

from deployments.config import deep_merge, resolve_path
from tests.k8s.manifests import build, one, serve_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_builder(import_path: str):
    module, _, attr = import_path.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_embedded_serve_config_deploys_and_answers(tmp_path) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    config = serve_config(one(build("base"), "RayService"))
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    args = app["args"]
    overrides = {"gateway": {"grpc_port": free_port(), "grpc_host": "127.0.0.1"}}
    if not os.path.isdir(resolve_path(args["model"]["path"])):
        from tests.deployments.tiny_checkpoint import save_tiny_checkpoint

        overrides["model"] = {"path": str(save_tiny_checkpoint(tmp_path / "tiny-moe"))}
        overrides["engine"] = {"max_model_len": 256}
    args = deep_merge(args, overrides)
    http_port = free_port()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location=config["proxy_location"], http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(import_builder(app["import_path"])(args), name=app["name"], route_prefix=app["route_prefix"])
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"{base}/health", timeout=5)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the app did not become healthy in 60 s")
            time.sleep(0.25)
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": args["model"]["name"], "prompt": "Do you have rye bread?", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert 1 <= body["usage"]["completion_tokens"] <= 8
    finally:
        serve.shutdown()
        ray.shutdown()
