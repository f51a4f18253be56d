"""gRPC status codes for engine-side failures, in-process (no Ray, no model): a fake engine
answers each request with one error chunk, and the grpcio client must see the mapped code."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.tiny_tokenizer import build_tiny_tokenizer
from deployments.frontend import Frontend
from deployments.grpc_server import start_grpc_server
from deployments.metrics import GatewayMetrics
from deployments.proto import generate_pb2 as pb
from deployments.proto import generate_pb2_grpc as pb_grpc
from moeserve.config import AppConfig
from moeserve.errors import ErrorCode
from moeserve.protocol import GenerateChunk, Usage, error_chunk
from moeserve.sampling_params import TokenLogprob, TokenTrace


class ScriptedEngine:
    """Answers with one error chunk whose code is the prompt's text, or a short normal stream."""

    async def generate(self, request):
        text = self.tokenizer.decode(list(request.prompt_ids))
        if text in ErrorCode._value2member_map_:
            yield error_chunk(request.request_id, ErrorCode(text), f"scripted {text}")
            return
        k = request.params.logprobs
        logprobs = None if k is None else (TokenLogprob(5, -0.25, ((5, -0.25), (6, -1.5))[:k]),)
        p = request.params
        trace = None
        if p.trace_experts or p.trace_speculation:  # what the engine reports for what was asked
            trace = (TokenTrace(5, "draft" if p.trace_speculation else None,
                                ((1, (3, 0), (0.75, 0.25)),) if p.trace_experts else None),)
        yield GenerateChunk(request.request_id, (5,), finish_reason="stop", usage=Usage(len(request.prompt_ids), 1),
                            logprobs=logprobs, trace=trace)

    async def health(self):
        return {"status": "ok"}

    async def stats(self):
        return {}


@pytest.fixture(scope="module")
def frontend():
    tokenizer = build_tiny_tokenizer()
    engine = ScriptedEngine()
    engine.tokenizer = tokenizer
    cfg = AppConfig.from_dict({"model": {"name": "tiny"}, "engine": {"max_model_len": 64}})
    return Frontend(cfg, tokenizer, engine, GatewayMetrics())


@pytest.mark.parametrize("code,status", [
    (ErrorCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
    (ErrorCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    (ErrorCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ErrorCode.INTERNAL, grpc.StatusCode.INTERNAL),
])
def test_engine_errors_map_to_status_codes(frontend, code, status):
    async def main():
        server, port = await start_grpc_server(frontend, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerateServiceStub(channel)
                ok = [r async for r in stub.Generate(pb.GenerateRequest(model="tiny", prompt="fine"), timeout=10)]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.GenerateRequest(model="tiny", prompt=code.value), timeout=10):
                        pass
                return ok, e.value
        finally:
            await server.stop(grace=None)

    ok, error = asyncio.run(main())
    assert ok[-1].finish_reason == "stop" and ok[-1].text == frontend.tokenizer.decode([5])  # text is made here
    assert error.code() == status and f"scripted {code.value}" in error.details()


class DownEngine(ScriptedEngine):
    async def health(self):
        raise RuntimeError("engine replica is gone")


def test_standard_health_reflection_and_an_unset_model(frontend):
    """grpc.health.v1 follows the engine's health; reflection names every service; a request
    without `model` is for the served model (proto3 reads unset as the default)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    down = Frontend(frontend.cfg, frontend.tokenizer, DownEngine(), GatewayMetrics())
    down.engine.tokenizer = frontend.tokenizer

    async def check(fe: Frontend):
        server, port = await start_grpc_server(fe, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                statuses = [(await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)).status
                            for name in ("", "moeserve.v1.GenerateService")]
                refl = reflection_pb2_grpc.ServerReflectionStub(channel)
                answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = [s.name async for a in answers for s in a.list_services_response.service]
                unset = [r async for r in pb_grpc.GenerateServiceStub(channel).Generate(
                    pb.GenerateRequest(prompt="fine"), timeout=10)] if fe is frontend else None
                return statuses, names, unset
        finally:
            await server.stop(grace=None)

    statuses, names, unset = asyncio.run(check(frontend))
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert {"moeserve.v1.GenerateService", "grpc.health.v1.Health"} <= set(names)
    assert unset[-1].finish_reason == "stop"
    statuses, _, _ = asyncio.run(check(down))
    assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2


def generate_each(frontend, *requests: pb.GenerateRequest) -> list[list[pb.GenerateResponse]]:
    """Every response of each request, in turn, from a gRPC server on `frontend`."""
    async def main():
        server, port = await start_grpc_server(frontend, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerateServiceStub(channel)
                answers = []
                for req in requests:
                    answers.append([r async for r in stub.Generate(req)])
                return answers
        finally:
            await server.stop(None)

    return asyncio.run(main())


def test_logprobs_travel_both_ways(frontend):
    asked, plain = generate_each(frontend, pb.GenerateRequest(model="tiny", prompt="fine", logprobs=2),
                                 pb.GenerateRequest(model="tiny", prompt="fine"))
    (entry,) = asked[-1].logprobs
    assert (entry.token_id, entry.logprob) == (5, -0.25)
    assert [(t.token_id, t.logprob) for t in entry.top] == [(5, -0.25), (6, -1.5)]
    assert not plain[-1].logprobs


def test_the_trace_travels_both_ways(frontend):
    asked, sources, plain = generate_each(
        frontend, pb.GenerateRequest(model="tiny", prompt="fine", trace=pb.TraceOptions(experts=True, speculation=True)),
        pb.GenerateRequest(model="tiny", prompt="fine", trace=pb.TraceOptions(speculation=True)),
        pb.GenerateRequest(model="tiny", prompt="fine"))
    (entry,) = asked[-1].trace
    assert (entry.token_id, entry.source) == (5, "draft")
    (layer,) = entry.experts
    assert (layer.layer, list(layer.expert_ids), list(layer.weights)) == (1, [3, 0], [0.75, 0.25])
    (entry,) = sources[-1].trace
    assert entry.source == "draft" and not entry.experts
    assert not plain[-1].trace


CHAT = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])


@pytest.mark.parametrize("request_,status,needle", [
    (pb.GenerateRequest(model="gpt-4", prompt="fine"), grpc.StatusCode.NOT_FOUND, "does not exist"),
    (pb.GenerateRequest(prompt="fine", temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (pb.GenerateRequest(prompt="fine", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (pb.GenerateRequest(prompt="fine", max_tokens=1000), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    (pb.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[10**6])), grpc.StatusCode.INVALID_ARGUMENT, "token ids"),
    (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "one of prompt"),
    (pb.GenerateRequest(prompt="fine", json_schema="{not json"), grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
    (pb.GenerateRequest(prompt="fine", tool_choice="required"), grpc.StatusCode.INVALID_ARGUMENT, "chat input"),
    (pb.GenerateRequest(chat=CHAT, tools=[pb.FunctionTool(name="f")], tool_choice="g"),
     grpc.StatusCode.INVALID_ARGUMENT, "not in tools"),
    (pb.GenerateRequest(chat=CHAT, tools=[pb.FunctionTool(name="f", parameters="{x")]),
     grpc.StatusCode.INVALID_ARGUMENT, "not JSON"),
    (pb.GenerateRequest(chat=CHAT, tools=[pb.FunctionTool(name="f")], tool_choice="f", regex="a"),
     grpc.StatusCode.INVALID_ARGUMENT, "cannot be combined"),
])
def test_bad_requests_are_mapped_with_a_message(frontend, request_, status, needle):
    async def main():
        server, port = await start_grpc_server(frontend, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [r async for r in pb_grpc.GenerateServiceStub(channel).Generate(request_, timeout=10)]
                return e.value
        finally:
            await server.stop(grace=None)

    error = asyncio.run(main())
    assert error.code() == status and needle in error.details(), error.details()
