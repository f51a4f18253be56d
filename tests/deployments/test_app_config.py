"""The app config, the Serve builder, the CLI's `serve` command and the gRPC stubs (no Ray started)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from moeserve.config import PROJECT_ROOT, AppConfig
from moeserve.engine.factory import model_path, speculation

SERVE_CONFIG = PROJECT_ROOT / "deployments" / "serve_config.yaml"


def test_shipped_serve_config_is_valid_and_deliberate():
    cfg = AppConfig.load(SERVE_CONFIG)
    model = model_path(cfg)
    assert Path(model).is_absolute() and model.endswith("checkpoints/demo-moe")
    for part in (cfg.deployments.gateway, cfg.deployments.engine):
        opts = part.serve_options()
        assert opts["max_ongoing_requests"] > 5 and "autoscaling_config" in opts
    # the engine replica admits exactly what its own admission control queues
    assert cfg.deployments.engine.max_ongoing_requests == cfg.engine.max_num_seqs + cfg.engine.max_queued_requests
    assert AppConfig.from_dict({"config": "deployments/serve_config.yaml"}) == cfg
    # the demo pair's draft in the engine's process, k chosen where it pays (no static cut-off)
    s = cfg.speculative
    assert speculation(cfg) == "model" and s.adaptive and s.disable_by_batch_size == 0 and s.num_tokens == 8


def test_overrides_and_errors():
    cfg = AppConfig.from_dict({"config": str(SERVE_CONFIG), "speculative": {"draft": "model"}, "gateway": {"grpc_port": 0}})
    assert speculation(cfg) == "model"
    assert cfg.gateway.grpc_port == 0  # the gateway starts no gRPC server
    with pytest.raises(ValidationError, match="extra"):
        AppConfig.from_dict({"engine": {"max_num_seq": 4}})  # typo: unknown keys are refused
    with pytest.raises(ValidationError, match="never let the batch fill"):
        AppConfig.from_dict({"engine": {"max_num_seqs": 32}, "deployments": {"engine": {"max_ongoing_requests": 5}}})
    with pytest.raises(ValidationError, match="num_replicas or autoscaling"):
        AppConfig.from_dict({"deployments": {"gateway": {"num_replicas": 2, "max_ongoing_requests": 8,
                                                         "autoscaling": {"target_ongoing_requests": 4}}}})


def test_build_app_binds_without_starting_ray():
    from ray.serve import Application

    from deployments.app import build_app

    assert isinstance(build_app({"config": str(SERVE_CONFIG)}), Application)
    sharded = AppConfig.from_dict({"shards": {"num_shards": 4, "gpus_per_shard": 1, "strategy": "STRICT_PACK"},
                                   "model": {"dtype": "bfloat16"}})
    shards = sharded.shards
    assert (shards.num_shards, shards.gpus_per_shard, shards.strategy) == (4, 1, "STRICT_PACK")
    assert sharded.model.dtype == "bfloat16"
    assert isinstance(build_app(sharded.model_dump()), Application)


def test_cli_serve_parses_and_the_cli_module_does_not_load_ray():
    code = (
        "import sys, json; from deployments.cli import build_parser; "
        "a = build_parser().parse_args(['serve', '--shards', '1', '--draft', 'model', '--http-port', '8001', "
        "'--grpc-port', '9001']); "
        "print(json.dumps([a.command, a.shards, a.draft, a.http_port, a.grpc_port, 'ray' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["serve", 1, "model", 8001, 9001, False]


def test_grpc_stubs_match_the_proto(tmp_path):
    from deployments.proto import build_stubs

    def code(text: str) -> str:  # the generators' version stamps aside (a newer grpcio-tools writes its own)
        text = re.sub(r"(GRPC_GENERATED_VERSION = |# Protobuf Python Version: ).*", r"\1", text)
        return re.sub(r"ValidateProtobufRuntimeVersion\([^)]*\)", "", text)

    assert build_stubs.main(tmp_path) == 0
    for name in ("generate_pb2.py", "generate_pb2_grpc.py"):
        assert code((tmp_path / name).read_text()) == code((PROJECT_ROOT / "deployments" / "proto" / name).read_text()), (
            f"{name} is stale: run python deployments/proto/build_stubs.py"
        )


def test_draft_deployment_is_bound_only_when_asked_for():
    from deployments.app import _bind_draft, build

    assert _bind_draft(AppConfig.from_dict({"speculative": {"draft": "model"}})) is None  # in-process by default
    cfg = AppConfig.from_dict({"speculative": {"draft": "model", "placement": "deployment", "draft_cpus": [1]},
                               "deployments": {"draft": {"num_replicas": 2, "max_ongoing_requests": 8}}})
    draft = _bind_draft(cfg)
    assert draft is not None and draft._bound_deployment.name == "draft"
    assert draft._bound_deployment.num_replicas == 2
    scaled = AppConfig.from_dict({"speculative": {"draft": "model", "placement": "deployment"}, "deployments": {
        "draft": {"max_ongoing_requests": 8, "autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}}}})
    assert _bind_draft(scaled)._bound_deployment._deployment_config.autoscaling_config.max_replicas == 3
    assert draft._bound_deployment.init_args[0].cpus == (1,)  # each worker process pinned to CPU 1
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="draft_cpus"):
            AppConfig.from_dict({"speculative": {"draft_cpus": bad}})
    app = build(cfg)  # gateway -> engine -> draft
    engine = app._bound_deployment.init_args[0]
    assert engine._bound_deployment.init_kwargs["draft"]._bound_deployment.name == "draft"
