"""The whole app on a local Ray Serve: the official openai client over HTTP, a grpcio client built
from the shipped proto, every grammar kind end to end, bad input, cancellation. One Ray instance
for the module (4 logical CPUs, 1 gateway + 1 engine replica), shut down at the end. The tokens come
on the engine replica's token socket (`gateway.direct_tokens`); other Serve tests use the Serve call."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import jsonschema
import openai
import pytest

from bench.oracle import check_output
from bench.serve_app import serve_app
from bench.tiny_checkpoint import MODEL_NAME, save_tiny_checkpoint
from deployments.proto import generate_pb2 as pb
from deployments.proto import generate_pb2_grpc as pb_grpc
from moeserve.grammar import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 10},
        "qty": {"type": "integer", "minimum": 1, "maximum": 12},
        "rush": {"type": "boolean"},
    },
    "required": ["item", "qty", "rush"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from deployments.app import APP_NAME, build_app

    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))
    one = {"num_replicas": 1, "num_cpus": 0.5}

    def build(grpc_port: int) -> tuple:
        config = {
            "model": {"path": str(folder), "name": MODEL_NAME},
            "engine": {"max_num_seqs": 8, "max_model_len": 256, "max_queued_requests": 16, "expert_load_report_s": 1},
            "speculative": {"draft": "ngram", "num_tokens": 3},
            "gateway": {"grpc_port": grpc_port, "grpc_host": "127.0.0.1", "direct_tokens": True},
            "deployments": {"gateway": {**one, "max_ongoing_requests": 64},
                            "engine": {**one, "max_ongoing_requests": 24}},
        }
        return build_app(config), APP_NAME, "/"

    with serve_app(build) as urls:
        yield {**urls, "folder": str(folder)}


def client(app) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=f"{app['http']}/v1", max_retries=0, timeout=60)


def test_openai_client_completion_chat_stream_and_json_schema(app):
    c = client(app)
    comp = c.completions.create(model=MODEL_NAME, prompt="The bakery sells", max_tokens=8, temperature=0)
    assert comp.usage.completion_tokens <= 8
    chat = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                     temperature=0)
    stream = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       temperature=0, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == chat.choices[0].message.content
    rf = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}
    r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Order"}],
                                  response_format=rf, max_tokens=60, temperature=1.0, seed=5)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_served_greedy_text_equals_the_offline_engine(app):
    """The served stack (gateway -> replica -> core process) writes exactly what `LLM.generate`
    writes in this process on the same settings."""
    from moeserve import LLM, SamplingParams

    prompts = ["The bakery sells", "Order: two loaves", "Hello my"]
    c = client(app)
    served = [c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    llm = LLM(app["folder"], "ngram", num_tokens=3, max_num_seqs=8, max_model_len=256)
    offline = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert served == [o.text for o in offline] and all(len(o.token_ids) == 24 for o in offline)
    health = httpx.get(f"{app['http']}/health", timeout=10).json()
    assert health["engine"]["core_restarts"] == 0


@pytest.mark.parametrize("extra,spec", [
    ({"response_format": {"type": "json_object"}}, GrammarSpec.json_object()),
    ({"guided_json": SCHEMA}, GrammarSpec.json_schema(SCHEMA)),
    ({"guided_regex": r"\d{3}-[a-z]{2}"}, GrammarSpec.regex(r"\d{3}-[a-z]{2}")),
    ({"guided_choice": ["rye", "spelt"]}, GrammarSpec.choice(["rye", "spelt"])),
    ({"guided_grammar": 'root ::= "ok" | "not ok"'}, GrammarSpec.choice(["ok", "not ok"])),  # same language
])
def test_every_grammar_kind_through_serve(app, extra, spec):
    c = client(app)
    parts, reason = [], None
    for ch in c.completions.create(model=MODEL_NAME, prompt="A: ", max_tokens=80, temperature=1.0, seed=11,
                                   stream=True, extra_body=extra):
        parts.append(ch.choices[0].text)
        reason = ch.choices[0].finish_reason or reason
    assert reason == "stop" and check_output(spec, "".join(parts)) is None, "".join(parts)


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL_NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL_NAME, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "word " * 400}, 400, "context"),
    ({"model": MODEL_NAME, "prompt": "x", "guided_regex": "a{"}, 400, "regex"),
    ({"model": MODEL_NAME, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "not": {"pattern": "^a"}}}}}, 400, "not"),
])
def test_bad_input_through_serve(app, body, status, needle):
    r = httpx.post(f"{app['http']}/v1/completions", json=body, timeout=30)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


def test_oversized_body_is_413(app):
    r = httpx.post(f"{app['http']}/v1/completions", content=b"x" * (3 << 20),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413


def test_grpc_generate_streams_and_validates(app):
    with grpc.insecure_channel(app["grpc"]) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.SERVING
        req = pb.GenerateRequest(model=MODEL_NAME, prompt="Order: ", max_tokens=60, temperature=1.0, seed=2,
                                 json_schema=json.dumps(SCHEMA))
        responses = list(stub.Generate(req, timeout=60))
        assert responses[-1].finish_reason == "stop" and all(not r.finish_reason for r in responses[:-1])
        jsonschema.validate(json.loads("".join(r.text for r in responses)), SCHEMA)
        assert responses[-1].usage.completion_tokens == sum(len(r.token_ids) for r in responses)

        chat = pb.GenerateRequest(model=MODEL_NAME, chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user",
                                  content="hi")]), max_tokens=5, temperature=0)
        assert list(stub.Generate(chat, timeout=60))[-1].finish_reason in ("stop", "length")

        cases = [
            (pb.GenerateRequest(model=MODEL_NAME, prompt="x", temperature=-2), grpc.StatusCode.INVALID_ARGUMENT,
             "temperature"),
            (pb.GenerateRequest(model=MODEL_NAME, prompt="x", regex="(["), grpc.StatusCode.INVALID_ARGUMENT, "regex"),
            (pb.GenerateRequest(model=MODEL_NAME), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
            (pb.GenerateRequest(model="other", prompt="x"), grpc.StatusCode.NOT_FOUND, "other"),
        ]
        for bad, code, needle in cases:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(bad, timeout=30))
            assert e.value.code() == code and needle in e.value.details()


def test_grpc_deadline_and_cancellation_free_the_engine(app):
    with grpc.insecure_channel(app["grpc"]) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        # sampled on a random model, so prompt lookup rarely pays: about one token per step
        long = pb.GenerateRequest(model=MODEL_NAME, prompt="x", max_tokens=240, temperature=1.0, seed=3,
                                  ignore_eos=True)
        started = time.perf_counter()
        assert list(stub.Generate(long, timeout=60))[-1].finish_reason == "length"
        full = time.perf_counter() - started  # a deadline well inside this cannot be met, however fast the machine
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(long, timeout=full / 5))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        call = stub.Generate(long, timeout=30)
        next(call)
        call.cancel()
    with httpx.stream("POST", f"{app['http']}/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
        next(r.iter_lines())  # then hang up mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{app['http']}/metrics", timeout=10).text
        if 'moeserve_engine{name="live_requests"} 0.0' in metrics:
            break
        time.sleep(0.2)
    assert 'moeserve_engine{name="live_requests"} 0.0' in metrics
    assert "moeserve_grammar_guard_refusals_total 0.0" in metrics


def test_expert_load_reaches_metrics_and_the_router_service(app):
    httpx.post(f"{app['http']}/v1/completions", timeout=30,
               json={"model": MODEL_NAME, "prompt": "count the experts", "max_tokens": 8})
    metrics = httpx.get(f"{app['http']}/metrics", timeout=10).text
    assert 'moeserve_expert_balance{layer="0"}' in metrics
    assert 'moeserve_expert_routed_fraction{expert="0",layer="0"}' in metrics
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the engine reports every second, counters only grow
        r = httpx.get(f"{app['http']}/admin/experts", params={"world_size": 2}, timeout=10)
        if r.status_code == 200 and r.json()["layers"][0]["tokens"] > 0:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    body = r.json()
    layer = body["layers"][0]
    assert layer["tokens"] > 0 and layer["routes"] == layer["tokens"] * 2
    assert abs(sum(layer["f"]) - 1) < 1e-6
    experts = sorted({e for rank in body["placement"]["rank_experts"] for e in rank})
    assert experts == list(range(len(layer["f"]))) and body["placement"]["world_size"] == 2
