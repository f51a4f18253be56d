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

import httpx

from bench.serve_app import serve_app
from moeserve.config import deep_merge, resolve_path
from tests.k8s.manifests import build, one, serve_config


def import_builder(import_path: str):
    module, _, attr = import_path.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_embedded_serve_config_deploys_and_answers(tmp_path) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = serve_config(one(build("base"), "RayService"))
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    args = app["args"]
    overrides = {}
    if not os.path.isdir(resolve_path(args["model"]["path"])):
        from bench.tiny_checkpoint import save_tiny_checkpoint

        overrides["model"] = {"path": str(save_tiny_checkpoint(tmp_path / "tiny-moe"))}
        overrides["engine"] = {"max_model_len": 256}

    def build_from_config(grpc_port: int) -> tuple:
        built = deep_merge(args, {**overrides, "gateway": {"grpc_port": grpc_port, "grpc_host": "127.0.0.1"}})
        return import_builder(app["import_path"])(built), app["name"], app["route_prefix"]

    with serve_app(build_from_config, proxy_location=config["proxy_location"]) as urls:
        base = urls["http"]
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": args["model"]["name"], "prompt": "Do you have rye bread?", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})  # (a model may well end its reply at once; the deployment is what is tested)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 8
