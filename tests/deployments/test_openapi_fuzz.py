"""schemathesis against the gateway's own OpenAPI (in-process, tiny model): every generated request,
valid or not, gets an answer that is not a 5xx, whose status the schema documents, and whose body
matches the documented schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

from bench.tiny_checkpoint import MODEL_NAME, save_tiny_checkpoint
from deployments.engine_server import EngineServer
from deployments.gateway import Gateway
from model_shards import load_checkpoint
from moeserve.config import AppConfig
from moeserve.engine import LLMEngine, ModelRunner
from moeserve.tokenizer import load_tokenizer

MAX_LEN = 64  # short contexts: a generated request runs at most a few dozen tiny steps


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))
    tokenizer = load_tokenizer(folder)
    tree = AppConfig.from_dict({"model": {"name": MODEL_NAME, "path": str(folder)}, "engine": {"max_model_len": MAX_LEN},
                                "gateway": {"grpc_port": None, "request_timeout_s": 30}})
    server = EngineServer(tree, engine=LLMEngine(ModelRunner(load_checkpoint(folder), 4, MAX_LEN), tokenizer))
    gateway = Gateway(server, tree)
    yield schemathesis.openapi.from_asgi("/openapi.json", gateway.http_app)
    server.shutdown()


def test_no_5xx_and_every_answer_is_documented(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health", "/admin/experts"}
    calls = []
    for op in operations:

        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case) -> None:
            calls.append(case.call_and_validate(checks=[not_a_server_error, status_code_conformance,
                                                         response_schema_conformance]).status_code)

        check()
    assert len(calls) >= 5 * len(operations) and 200 in calls and 400 in calls  # both sides of validation ran
