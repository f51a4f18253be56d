"""The gateway's HTTP API in-process (no Ray): the official openai client, raw SSE, every grammar
kind, every kind of bad input (a 4xx with a message, never a 500), metrics and the stream guard."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import jsonschema
import openai
import pytest
import torch

from bench.oracle import check_output
from bench.tiny_checkpoint import MODEL_NAME, save_tiny_checkpoint
from bench.tool_calls import json_prefix
from deployments.engine_server import EngineServer
from deployments.frontend import ServeRequest
from deployments.gateway import Gateway
from model_shards import load_checkpoint
from moeserve.config import AppConfig
from moeserve.engine import LLMEngine, ModelRunner, SpecConfig
from moeserve.grammar import GrammarSpec
from moeserve.spec.ngram import NgramProposer
from moeserve.tokenizer import load_tokenizer

MAX_LEN = 256
SCHEMA = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 10},
        "size": {"enum": ["small", "large"]},
        "qty": {"type": "integer", "minimum": 1, "maximum": 12},
    },
    "required": ["item", "size", "qty"],
    "additionalProperties": False,
}


def _gateway(folder, max_len: int):
    tokenizer = load_tokenizer(folder)
    engine = LLMEngine(ModelRunner(load_checkpoint(folder), 8, max_len), tokenizer, proposer=NgramProposer(),
                       spec=SpecConfig(num_tokens=3))
    tree = AppConfig.from_dict({"model": {"name": MODEL_NAME, "path": str(folder)}, "engine": {"max_model_len": max_len},
                                "gateway": {"grpc_port": None, "max_body_bytes": 64 * 1024}})
    server = EngineServer(tree, engine=engine)
    return server, Gateway(server, tree)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def gateway(folder):
    server, gw = _gateway(folder, MAX_LEN)
    yield gw
    server.shutdown()


@pytest.fixture(scope="module")
def long_gateway(folder):
    """Room for tool definitions in the prompt (the tiny tokenizer spends a token on most characters)."""
    server, gw = _gateway(folder, 1024)
    yield gw
    server.shutdown()


def http(gw: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.http_app), base_url="http://gateway", timeout=60)


def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="none", base_url="http://gateway/v1", http_client=http(gw), max_retries=0)


def test_openai_completion_chat_and_streaming(gateway):
    async def main():
        c = client(gateway)
        comp = await c.completions.create(model=MODEL_NAME, prompt="The bakery sells", max_tokens=8, temperature=0)
        chat = await c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, seed=1)
        stream = await c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        again = await c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, temperature=0)
        models = await c.models.list()
        return comp, chat, chunks, again, models

    comp, chat, chunks, again, models = asyncio.run(main())
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens <= 8
    assert comp.usage.prompt_tokens == len(load_tokenizer(gateway.config.model.path).encode("The bakery sells"))
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == again.choices[0].message.content  # greedy: streaming and not give the same text
    assert chunks[-1].usage.completion_tokens == again.usage.completion_tokens
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_logprobs_chat_and_completions_streamed_and_not(gateway):
    """The openai client reads logprobs: values <= 0; a greedy token is the most likely one; a
    sampled token (top_k 5, so the final distribution has 5 tokens) is among the top 5; one
    entry per generated token; the tokens' bytes spell the text."""
    chat = [{"role": "user", "content": "Do you have rye bread?"}]

    async def main():
        c = client(gateway)
        greedy = await c.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
        stream = await c.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=12, temperature=0.9,
                                                 seed=5, logprobs=True, top_logprobs=5, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"top_k": 5, "ignore_eos": True})
        chunks = [ch async for ch in stream]
        comp = await c.completions.create(model=MODEL_NAME, prompt="The bakery sells", max_tokens=10,
                                          temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        plain = await c.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=4, temperature=0)
        return greedy, chunks, comp, plain

    greedy, chunks, comp, plain = asyncio.run(main())
    content = greedy.choices[0].logprobs.content
    assert len(content) == greedy.usage.completion_tokens == 12
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.token == e.top_logprobs[0].token and e.logprob == max(t.logprob for t in e.top_logprobs)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == greedy.choices[0].message.content

    sampled = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(sampled) == chunks[-1].usage.completion_tokens == 12
    for e in sampled:
        assert e.logprob <= 0 and 1 <= len(e.top_logprobs) <= 5
        assert e.token in [t.token for t in e.top_logprobs]
        assert abs(sum(math.exp(t.logprob) for t in e.top_logprobs) - 1) < 1e-4  # the whole distribution

    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert plain.choices[0].logprobs is None  # off unless asked for


def test_n_choices_are_indexed_seeded_and_streamed(gateway):
    """n choices: indices 0..n-1; choice i of a seeded request is the request with seed + i alone,
    and the same again; streamed choices equal the non-streamed ones; greedy choices agree."""
    async def main():
        c = client(gateway)
        ask = dict(model=MODEL_NAME, prompt="The bakery sells", max_tokens=8, temperature=0.9, seed=7)
        three = await c.completions.create(n=3, **ask)
        again = await c.completions.create(n=3, **ask)
        alone = [await c.completions.create(**{**ask, "seed": 7 + i}) for i in range(3)]
        chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.8,
                    seed=3, n=2)
        whole = await c.chat.completions.create(**chat)
        stream = await c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat)
        chunks = [ch async for ch in stream]
        greedy = await c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=6, temperature=0, n=2)
        return three, again, alone, whole, chunks, greedy

    three, again, alone, whole, chunks, greedy = asyncio.run(main())
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert [ch.text for ch in three.choices] == [ch.text for ch in again.choices] == [a.choices[0].text for a in alone]
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert three.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = {0: "", 1: ""}
    finished = set()
    for ch in chunks:
        for choice in ch.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and [streamed[0], streamed[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert greedy.choices[0].text == greedy.choices[1].text


ORDER = {"type": "object", "properties": {"item": {"enum": ["rye", "baguette", "croissant"]},
                                        "quantity": {"type": "integer", "minimum": 1, "maximum": 12}},
         "required": ["item", "quantity"], "additionalProperties": False}
PRICE = {"type": "object", "properties": {"item": {"enum": ["rye", "baguette"]}}, "required": ["item"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "place_order", "description": "Order bread", "parameters": ORDER}},
         {"type": "function", "function": {"name": "get_price", "parameters": PRICE}}]
SCHEMAS = {"place_order": ORDER, "get_price": PRICE}


def test_tool_calls_required_and_named_streamed_and_not_then_a_round_trip(long_gateway):
    """tool_choice required / a named function: the openai client reads tool_calls whose
    arguments validate against the function's schema, streamed (whole calls per delta) and not;
    the call and its result go back as messages and render through the chat template."""
    ask = [{"role": "user", "content": "Two rye loaves please"}]

    gateway = long_gateway

    async def main():
        c = client(gateway)
        common = dict(model=MODEL_NAME, messages=ask, tools=TOOLS, max_tokens=200, temperature=1.0)
        required = await c.chat.completions.create(tool_choice="required", parallel_tool_calls=False, seed=2,
                                                   **common)
        named = await c.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_price"}},
                                                stream=True, seed=4, **common)
        chunks = [ch async for ch in named]
        call = required.choices[0].message.tool_calls[0]
        follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'}]
        after = await c.chat.completions.create(model=MODEL_NAME, messages=follow, tools=TOOLS, max_tokens=4,
                                                temperature=0)
        return required, chunks, follow, after

    required, chunks, follow, after = asyncio.run(main())
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    streamed: dict[int, dict] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and streamed
    for entry in streamed.values():  # parallel calls allowed: one or more, all of the named function
        assert entry["name"] == "get_price"
        jsonschema.validate(json.loads(entry["arguments"]), PRICE)

    ids = gateway.frontend.encode(ServeRequest(MODEL_NAME, messages=follow, tools=TOOLS))
    prompt = load_tokenizer(gateway.config.model.path).decode(ids)
    assert "<tool_response>" in prompt and call.function.name in prompt and "place_order" in prompt
    assert after.choices[0].message.role == "assistant"


def test_tool_calls_named_required_and_auto_whole_and_cut_streamed_and_not(long_gateway):
    """Named: exactly one call of that function; required, parallel off: one call; cut by max_tokens:
    still a call, finish_reason "length", arguments a prefix of valid JSON; auto: never call syntax in
    content. Each streamed and not."""
    ask = [{"role": "user", "content": "Two rye loaves please"}]
    named = {"type": "function", "function": {"name": "place_order"}}
    cases = [(choice, parallel, max_tokens, stream)
             for choice, parallel in ((named, True), ("required", False), ("required", True), ("auto", True),
                                      ("auto", False), ("none", True))
             for max_tokens in (6, 200) for stream in (False, True)]

    async def run(choice, parallel, max_tokens, stream):
        c = client(long_gateway)
        r = await c.chat.completions.create(model=MODEL_NAME, messages=ask, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=parallel, max_tokens=max_tokens, temperature=1.0,
                                            seed=7, stream=stream)
        if not stream:
            m = r.choices[0]
            return m.finish_reason, m.message.content, [(t.function.name, t.function.arguments)
                                                          for t in m.message.tool_calls or []]
        content, calls, finish = "", {}, None
        async for ch in r:
            d = ch.choices[0].delta
            content += d.content or ""
            for t in d.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
            finish = ch.choices[0].finish_reason or finish
        return finish, content or None, [calls[i] for i in sorted(calls)]

    async def main():
        return [await run(*case) for case in cases]

    for (choice, parallel, max_tokens, stream), (finish, content, calls) in zip(cases, asyncio.run(main())):
        case = (choice, parallel, max_tokens, stream, finish, content, calls)
        assert "<tool_call" not in (content or "") and "</tool_call>" not in (content or ""), case
        if choice in ("auto", "none"):  # the tiny model writes no call syntax; tests/deployments/test_tools.py cuts calls
            assert not calls and finish in ("stop", "length"), case
            continue
        cut = max_tokens == 6
        assert content is None and finish == ("length" if cut else "tool_calls"), case
        if choice == named:
            assert [name for name, _ in calls] == ["place_order"], case  # exactly one call, named or cut
        elif not parallel:
            assert len(calls) <= 1 and (cut or len(calls) == 1), case
        for name, args in calls:
            if cut:
                assert json_prefix(args, SCHEMAS[name]), case
            else:
                jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_grpc_tool_calls_named_whole_and_cut_then_a_round_trip(long_gateway):
    """gRPC Generate with tools: a named tool_choice gives one call whose arguments validate (finish
    "tool_calls"); cut by max_tokens, one call with a JSON-prefix of arguments (finish "length");
    the call goes back in a chat and renders; text never carries call syntax."""
    import grpc

    from deployments.grpc_server import start_grpc_server
    from deployments.proto import generate_pb2 as pb
    from deployments.proto import generate_pb2_grpc as pb_grpc

    tools = [pb.FunctionTool(name=t["function"]["name"], description=t["function"].get("description", ""),
                             parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Two rye loaves please")])

    def ask(max_tokens: int, choice: str, messages=chat) -> pb.GenerateRequest:
        return pb.GenerateRequest(chat=messages, tools=tools, tool_choice=choice, max_tokens=max_tokens,
                                  temperature=1.0, seed=5)

    async def main():
        server, port = await start_grpc_server(long_gateway.frontend, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerateServiceStub(channel)
                out = []
                for req in (ask(200, "place_order"), ask(6, "place_order"), ask(6, "auto")):
                    out.append([r async for r in stub.Generate(req, timeout=60)])
                (call,) = out[0][-1].tool_calls
                follow = pb.ChatMessages(messages=[*chat.messages, pb.ChatMessage(role="assistant", tool_calls=[call]),
                                                   pb.ChatMessage(role="tool", tool_call_id=call.id, content="ok")])
                out.append([r async for r in stub.Generate(ask(4, "auto", follow), timeout=60)])
                return out
        finally:
            await server.stop(None)

    whole, cut, auto, after = asyncio.run(main())
    (call,) = whole[-1].tool_calls
    assert whole[-1].finish_reason == "tool_calls" and call.name == "place_order" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ORDER)
    assert all(not r.tool_calls for r in whole[:-1]) and not "".join(r.text for r in whole)
    (call,) = cut[-1].tool_calls
    assert cut[-1].finish_reason == "length" and call.name == "place_order" and json_prefix(call.arguments, ORDER)
    assert "<tool_call" not in "".join(r.text for r in auto) and after[-1].finish_reason in ("stop", "length")


def test_tool_choice_errors_are_clear_400s(gateway):
    ask = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "function name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ]
    for extra, needle in cases:
        r = asyncio.run(_post(gateway, "/v1/chat/completions", {**ask, **extra}))
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_response_format_json_schema_validates(gateway):
    async def main():
        c = client(gateway)
        rf = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}
        return await asyncio.gather(*(
            c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Order bread"}],
                                      response_format=rf, max_tokens=80, temperature=1.0, seed=s)
            for s in range(4)
        ))

    for r in asyncio.run(main()):
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


GRAMMARS = {
    "json_object": ({"response_format": {"type": "json_object"}}, GrammarSpec.json_object()),
    "regex": ({"guided_regex": r"[A-Z]{2}\d{3}"}, GrammarSpec.regex(r"[A-Z]{2}\d{3}")),
    "choice": ({"guided_choice": ["sourdough", "baguette", "rye"]}, GrammarSpec.choice(["sourdough", "baguette", "rye"])),
    "ebnf": ({"guided_grammar": 'root ::= "yes" | "no" | "n/a"'}, None),
    "guided_json": ({"guided_json": SCHEMA}, GrammarSpec.json_schema(SCHEMA)),
}


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("stream", [False, True])
def test_every_grammar_kind_end_to_end(gateway, kind, stream):
    extra, spec = GRAMMARS[kind]

    async def main():
        c = client(gateway)
        kwargs = dict(model=MODEL_NAME, prompt="Answer: ", max_tokens=80, temperature=1.0, seed=7, extra_body=extra)
        if not stream:
            r = await c.completions.create(**kwargs)
            return r.choices[0].text, r.choices[0].finish_reason
        parts, reason = [], None
        async for ch in await c.completions.create(stream=True, **kwargs):
            parts.append(ch.choices[0].text)
            reason = ch.choices[0].finish_reason or reason
        return "".join(parts), reason

    text, reason = asyncio.run(main())
    assert reason == "stop", text
    if spec is not None:
        assert check_output(spec, text) is None, text
    else:
        assert text in ("yes", "no", "n/a")
    assert gateway.metrics.grammar_guard_refusals._value.get() == 0


def test_sse_wire_format(gateway):
    async def main():
        async with http(gateway) as h:
            body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0}
            r = await h.post("/v1/completions", json=body)
            return r

    r = asyncio.run(main())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert {p["object"] for p in payloads} == {"text_completion"} and len({p["id"] for p in payloads}) == 1
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


BAD = [
    ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "x", "n": 17}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL_NAME, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"model": MODEL_NAME, "prompt": ["a", "b"]}, 400, "single prompt"),
    ({"model": MODEL_NAME, "prompt": ""}, 400, "empty"),
    ({"model": MODEL_NAME, "prompt": [5000]}, 400, "token ids"),
    ({"model": MODEL_NAME}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "the " * 300}, 400, "context"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 1000}, 400, "context"),
    ({"model": MODEL_NAME, "prompt": "x", "guided_regex": "(["}, 400, "regex"),
    ({"model": MODEL_NAME, "prompt": "x", "guided_grammar": "root ::= ("}, 400, "ebnf"),
    ({"model": MODEL_NAME, "prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ({"model": MODEL_NAME, "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400, "at most one"),
    ({"model": MODEL_NAME, "prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"model": MODEL_NAME, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "u", "schema": {"type": "array", "uniqueItems": True, "minItems": 2}}}}, 400, "uniqueItems"),
    ({"model": MODEL_NAME, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "bogus"}}}}, 400, "bogus"),
]
BAD_CHAT = [
    ({"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text parts"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, 400,
     "max_tokens"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30},
     400, "top_logprobs"),
]


OFFLINE_BAD = [  # (the served request's grammar fields, the same as StructuredOutputsParams)
    ({"guided_regex": "(["}, {"regex": "(["}),
    ({"guided_grammar": "root ::= ("}, {"grammar": "root ::= ("}),
    ({"guided_choice": []}, {"choice": []}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": {
        "type": "array", "uniqueItems": True, "minItems": 2}}}}, {"json": {"type": "array", "uniqueItems": True,
                                                                           "minItems": 2}}),
    ({"guided_json": {"type": "bogus"}}, {"json": {"type": "bogus"}}),
]


def test_the_offline_api_refuses_a_bad_grammar_with_the_servers_400_message(gateway, folder):
    from moeserve import LLM, SamplingParams, StructuredOutputsParams
    from moeserve.grammar import GrammarError

    llm = LLM(str(folder), "none", max_model_len=MAX_LEN)
    for served, offline in OFFLINE_BAD:
        r = asyncio.run(_post(gateway, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", **served}))
        assert r.status_code == 400, r.text
        with pytest.raises(GrammarError) as e:
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**offline)))
        assert str(e.value) == r.json()["error"]["message"]
    assert not llm.engine.has_unfinished()  # nothing was queued


@pytest.mark.parametrize("route,body,status,needle", [("/v1/completions", *b) for b in BAD]
                         + [("/v1/chat/completions", *b) for b in BAD_CHAT])
def test_bad_input_gets_a_4xx_with_a_message(gateway, route, body, status, needle):
    for stream in (False, True):
        r = asyncio.run(_post(gateway, route, {**body, "stream": stream}))
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert needle.lower() in error["message"].lower(), error
        assert set(error) == {"message", "type", "param", "code"}


def test_raw_body_errors(gateway):
    bad_json = asyncio.run(_post(gateway, "/v1/completions", content=b"{not json"))
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    huge = asyncio.run(_post(gateway, "/v1/completions", content=b"x" * (65 * 1024)))
    assert huge.status_code == 413 and "larger than" in huge.json()["error"]["message"]
    not_found = asyncio.run(_get(gateway, "/v2/nothing"))
    assert not_found.status_code == 404


def test_metrics_and_health(gateway):
    asyncio.run(_post(gateway, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 3}))
    asyncio.run(_post(gateway, "/v1/completions", {"model": "nope", "prompt": "x"}))
    text = asyncio.run(_get(gateway, "/metrics")).text
    assert 'moeserve_requests_total{code="200",route="/v1/completions"}' in text
    assert 'moeserve_requests_total{code="404",route="/v1/completions"}' in text
    for name in ("moeserve_time_to_first_token_seconds_count", "moeserve_e2e_request_latency_seconds_count",
                 "moeserve_generated_tokens_total", 'moeserve_engine{name="steps"}'):
        assert name in text
    assert "moeserve_grammar_guard_refusals_total 0.0" in text
    health = asyncio.run(_get(gateway, "/health"))
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_the_engine_guard_stops_a_refused_token_and_the_gateway_counts_it(gateway, monkeypatch):
    """A sampler that ignores the grammar mask (a bug): the core's matcher refuses the token,
    the stream ends with a 500 naming the guard, and the refusal is counted."""
    tokenizer = gateway.frontend.tokenizer
    engine = LLMEngine(ModelRunner(load_checkpoint(gateway.config.model.path), 2, MAX_LEN), tokenizer)
    bang = tokenizer.encode("!")[0]
    monkeypatch.setattr(engine.sampler, "sample", lambda logits, *_, **__: torch.full((logits.shape[0],), bang))
    server = EngineServer(gateway.config, engine=engine)
    liar = Gateway(server, gateway.config, tokenizer=tokenizer)
    try:
        body = {"model": MODEL_NAME, "prompt": "x", "guided_regex": "[a-z]+"}
        r = asyncio.run(_post(liar, "/v1/completions", body))
        assert r.status_code == 500 and "guard refused" in r.json()["error"]["message"]
        r = asyncio.run(_post(liar, "/v1/completions", {**body, "stream": True}))
        assert r.status_code == 500  # the refusal is the first chunk, so the status still says so
        assert liar.metrics.grammar_guard_refusals._value.get() == 2
    finally:
        server.shutdown()
    assert asyncio.run(_get(liar, "/health")).status_code == 503


async def _post(gw: Gateway, path: str, body: dict | None = None, content: bytes | None = None) -> httpx.Response:
    async with http(gw) as h:
        if content is not None:
            return await h.post(path, content=content, headers={"content-type": "application/json"})
        return await h.post(path, json=body)


async def _get(gw: Gateway, path: str) -> httpx.Response:
    async with http(gw) as h:
        return await h.get(path)


class StalledEngine:
    """An engine replica that accepted the call and then never answered."""

    async def generate(self, request):
        await asyncio.sleep(3600)
        yield  # pragma: no cover

    async def health(self):
        return {}

    async def stats(self):
        return {}


def test_a_stalled_engine_times_out_instead_of_hanging(gateway, monkeypatch):
    import deployments.frontend

    monkeypatch.setattr(deployments.frontend, "STALL_GRACE_S", 0.1)
    fe = gateway.frontend
    cfg = gateway.config.with_overrides({"gateway": {"request_timeout_s": 0.2}})
    stalled = Gateway(StalledEngine(), cfg, tokenizer=fe.tokenizer)
    r = asyncio.run(asyncio.wait_for(_post(stalled, "/v1/completions", {"model": MODEL_NAME, "prompt": "x"}), 10))
    assert r.status_code == 504 and "no answer" in r.json()["error"]["message"]


def test_stop_strings_and_seed(gateway):
    async def main():
        c = client(gateway)
        free = await c.completions.create(model=MODEL_NAME, prompt="The bakery sells", max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
        text = free.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = await c.completions.create(model=MODEL_NAME, prompt="The bakery sells", max_tokens=24, temperature=0,
                                         stop=[stop], extra_body={"ignore_eos": True})
        seeded = [await c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=12, temperature=1.0, seed=42)
                  for _ in range(2)]
        return text, stop, cut, seeded

    text, stop, cut, seeded = asyncio.run(main())
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert seeded[0].choices[0].text == seeded[1].choices[0].text


def test_admin_experts_answers_without_the_router_service(gateway):
    """No router-service actor (no Ray): 200 with this engine's own counters and the contiguous
    placement, not a 503."""
    async def main():
        async with http(gateway) as h:
            before = await h.get("/admin/experts?world_size=2")
            await h.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "The bakery", "max_tokens": 4})
            return before, await h.get("/admin/experts?world_size=2"), await gateway.frontend.engine.stats()

    before, after, stats = asyncio.run(main())
    assert before.status_code == after.status_code == 200, after.text
    tokens = [sum(layer["tokens"] for layer in r.json()["layers"]) for r in (before, after)]
    assert tokens[1] > tokens[0] and after.json()["sources"] == ["this replica"]
    assert after.json()["layers"] == stats["experts"]
    ranks = after.json()["placement"]["rank_experts"]
    assert len(ranks) == 2 and sorted(e for rank in ranks for e in rank) == list(range(4))


def test_api_keys_http_and_grpc(gateway, monkeypatch):
    """With keys: 401 (HTTP) / UNAUTHENTICATED (gRPC) without a valid one, health and metrics
    open, keys from $MOESERVE_API_KEY too, and a key's concurrent-request limit answered 429."""
    import grpc

    from deployments.grpc_server import start_grpc_server
    from deployments.proto import generate_pb2 as pb
    from deployments.proto import generate_pb2_grpc as pb_grpc

    monkeypatch.setenv("MOESERVE_API_KEY", "from-env, other")
    cfg = gateway.config.with_overrides({"gateway": {"api_keys": ["k1"], "max_streams_per_key": 1}})
    gw = Gateway(gateway.frontend.engine, cfg, tokenizer=gateway.frontend.tokenizer)
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}

    async def main():
        async with http(gw) as h:
            anonymous = await h.post("/v1/completions", json=body)
            wrong = await h.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
            ok = await h.post("/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
            env = await h.post("/v1/completions", json=body, headers={"Authorization": "Bearer other"})
            health, metrics, page = await h.get("/health"), await h.get("/metrics"), await h.get("/playground")
            # (the in-process transport runs a response to its end, so hold k1's slot by hand)
            assert gw.auth.acquire("k1")  # k1 now holds one request: its limit
            busy = await h.post("/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
            other = await h.post("/v1/completions", json=body, headers={"Authorization": "Bearer from-env"})
            gw.auth.release("k1")
            again = await h.post("/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
        return anonymous, wrong, ok, env, health, metrics, page, busy, other, again

    anonymous, wrong, ok, env, health, metrics, page, busy, other, again = asyncio.run(main())
    assert anonymous.status_code == wrong.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    assert ok.status_code == env.status_code == other.status_code == 200
    assert health.status_code == metrics.status_code == page.status_code == 200  # public paths
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1" and again.status_code == 200
    assert not gw.auth._streams  # every finished request gave its slot back

    async def rpc():
        server, port = await start_grpc_server(gw.frontend, "127.0.0.1", 0, auth=gw.auth)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerateServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    [r async for r in stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=30)]
                good = [r async for r in stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=30,
                                                        metadata=(("authorization", "Bearer k1"),))]
                return denied.value.code(), good
        finally:
            await server.stop(grace=None)

    code, good = asyncio.run(rpc())
    assert code == grpc.StatusCode.UNAUTHENTICATED and good[-1].finish_reason


def test_openapi_documents_every_status_with_the_error_schema(gateway):
    schema = asyncio.run(_get(gateway, "/openapi.json")).json()
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][route]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503", "504"}
        assert all(responses[s]["content"]["application/json"]["schema"] == error for s in responses if s != "200")
    assert "503" in schema["paths"]["/health"]["get"]["responses"]
    assert "503" in schema["paths"]["/admin/experts"]["get"]["responses"]
    assert set(schema["components"]["schemas"]["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}


def test_limits_are_clear_400s_in_the_error_shape(gateway):
    """Deep schemas, long regexes, too many or too long stop strings, an unparseable body: 400
    in OpenAI's error shape, before any engine work (and never a 500 from recursion)."""
    deep = {}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    bodies = {
        "nested": {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}},
        "characters": {"guided_regex": "a" * 20_000},
        "at most 16 strings": {"stop": ["x"] * 17},
        "at most 1024 characters": {"stop": ["x" * 2000]},
    }
    for needle, extra in bodies.items():
        r = asyncio.run(_post(gateway, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", **extra}))
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (needle, r.text)
    very_deep = '{"model":"' + MODEL_NAME + '","prompt":' + "[" * 20_000 + "]" * 20_000 + "}"
    r = asyncio.run(_post(gateway, "/v1/completions", content=very_deep.encode()))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert asyncio.run(_get(gateway, "/v2/nothing")).json()["error"]["type"] == "not_found_error"


def test_trace_reports_experts_and_sources_streamed_and_not(gateway):
    """The trace extension: one entry per generated token, its text spelling the output; experts
    per MoE layer (K distinct ids, gate weights summing to 1) on every decoded token; under a
    JSON schema the grammar's jump-forward tokens are "forced" (and have no routing); n-gram
    drafts the target accepted are "draft"; streamed chunks carry their tokens' entries."""
    body = {"model": MODEL_NAME, "prompt": "Order:", "max_tokens": 40, "temperature": 0,
            "guided_json": SCHEMA, "trace": {"experts": True, "speculation": True}}

    async def main():
        full = (await _post(gateway, "/v1/completions", body)).json()
        async with http(gateway) as h:
            streamed = await h.post("/v1/completions", json=body | {"stream": True})
        plain = (await _post(gateway, "/v1/completions", {k: v for k, v in body.items() if k != "trace"})).json()
        bad = [await _post(gateway, "/v1/completions", body | {"trace": t}) for t in ({"bogus": True}, "yes")]
        return full, streamed.text, plain, bad

    full, streamed, plain, bad = asyncio.run(main())
    choice = full["choices"][0]
    trace = choice["trace"]
    assert len(trace) == full["usage"]["completion_tokens"] and "".join(e["token"] for e in trace) == choice["text"]
    sources = {e["source"] for e in trace}
    assert "forced" in sources and sources <= {"target", "draft", "forced"}
    for e in trace:
        if e["source"] == "forced":
            assert e["experts"] is None
            continue
        assert [x["layer"] for x in e["experts"]] == sorted({x["layer"] for x in e["experts"]})
        for x in e["experts"]:
            assert len(set(x["ids"])) == len(x["ids"]) == 2 and abs(sum(x["weights"]) - 1) < 1e-3
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    streamed_trace = [e for ev in events for c in ev["choices"] for e in c.get("trace", [])]
    assert streamed_trace == trace  # greedy: the same tokens, routing and sources
    assert "trace" not in plain["choices"][0] and plain["choices"][0]["text"] == choice["text"]
    assert [r.status_code for r in bad] == [400, 400]


def test_the_playground_page_is_served_self_contained(gateway):
    """GET /playground: one HTML page from the package, nothing loaded from elsewhere (no CDN); it
    asks the chat route for a streamed trace and reads the live panels' sources."""
    import re

    async def main():
        async with http(gateway) as h:
            return await h.get("/playground"), await h.get("/admin/experts")

    page, experts = asyncio.run(main())
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # every resource is inline
    for used in ('"/v1/chat/completions"', "trace: {experts: true, speculation: true}", '"/metrics"',
                 '"/admin/experts"', '"/v1/models"', "json_schema", "spec_acceptance_rate", "spec_tokens_per_pass"):
        assert used in html
    layer = experts.json()["layers"][0]
    assert {"layer", "tokens", "f", "P", "balance"} <= set(layer)  # what the heatmap reads
