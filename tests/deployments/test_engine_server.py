"""EngineServer without Ray: streams, continuous batching, cancellation, errors that never hang."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from bench.oracle import check_output
from bench.tiny_checkpoint import save_tiny_checkpoint
from deployments.engine_server import EngineServer
from deployments.token_channel import TokenClient
from model_shards import load_checkpoint
from moeserve.config import AppConfig, EngineSection
from moeserve.engine import LLMEngine, ModelRunner
from moeserve.errors import ErrorCode
from moeserve.grammar import GrammarSpec
from moeserve.protocol import GenerateChunk, GenerateRequest
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import load_tokenizer
from tests.deployments.serve_stand_in import handle

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_tokenizer(folder)


def make_server(folder, tokenizer, max_num_seqs=4, queued=8, **config) -> EngineServer:
    engine = LLMEngine(ModelRunner(load_checkpoint(folder), max_num_seqs, 512), tokenizer)
    engine_section = {"max_queued_requests": queued, "stream_interval_s": 0, "stream_interval_max_s": 0, **config}
    return EngineServer(AppConfig.from_dict({"engine": engine_section}), engine=engine)


@pytest.fixture
def server(folder, tokenizer):
    srv = make_server(folder, tokenizer)
    yield srv
    srv.shutdown()


def request(rid: str, prompt: str, tokenizer, params=GREEDY, **kw) -> GenerateRequest:
    return GenerateRequest(rid, tuple(tokenizer.encode(prompt)), params, **kw)


async def collect(server: EngineServer, req: GenerateRequest, timeout: float = 60) -> list[GenerateChunk]:
    async def go():
        return [c async for c in server.generate(req)]

    return await asyncio.wait_for(go(), timeout)


def wait_idle(server: EngineServer, timeout: float = 10) -> None:
    """Until the engine thread has processed every abort (they are asynchronous)."""
    deadline = time.monotonic() + timeout
    while asyncio.run(server.stats())["live_requests"] and time.monotonic() < deadline:
        time.sleep(0.01)


def test_stream_matches_the_engine_and_reports_usage(server, folder, tokenizer):
    chunks = asyncio.run(collect(server, request("a", "The bakery sells", tokenizer)))
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    tokens = [t for c in chunks for t in c.token_ids]
    direct = LLMEngine(ModelRunner(load_checkpoint(folder), 1, 512), tokenizer).generate(["The bakery sells"], GREEDY)
    assert tokens == direct[0].token_ids and not any(c.text for c in chunks)  # token-only: text is the gateway's
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode("The bakery sells"))


def test_concurrent_requests_batch_and_match_solo_runs(server, tokenizer):
    prompts = ["Order: ", "The bakery sells", "Hello my", "Tomorrow we", "Please send", "A cake"]

    async def main():
        return await asyncio.gather(*(collect(server, request(f"r{i}", p, tokenizer)) for i, p in enumerate(prompts)))

    together = asyncio.run(main())  # 6 requests, 4 slots: two join as others finish
    for i, p in enumerate(prompts):
        solo = asyncio.run(collect(server, request(f"solo{i}", p, tokenizer)))
        assert [t for c in together[i] for t in c.token_ids] == [t for c in solo for t in c.token_ids]


def test_closing_the_stream_aborts_the_request(server, tokenizer):
    async def main():
        gen = server.generate(request("gone", "Order: ", tokenizer, LONG))
        await anext(gen)
        await anext(gen)
        await gen.aclose()  # what Serve does when the HTTP client disconnects

    asyncio.run(main())
    wait_idle(server)
    assert not server.engine.has_unfinished()
    assert server.engine.runner.num_free_slots == server.engine.runner.max_num_seqs
    assert asyncio.run(server.stats())["finished"].get("abort") == 1


def test_bad_prompt_and_bad_grammar_end_with_invalid_argument(server, tokenizer):
    too_long = GenerateRequest("long", tuple([5] * 600), GREEDY)
    (chunk,) = asyncio.run(collect(server, too_long))
    assert chunk.error.code is ErrorCode.INVALID_ARGUMENT and "context" in chunk.error.message
    bad = request("re", "x", tokenizer, grammar=GrammarSpec.regex("(["))
    (chunk,) = asyncio.run(collect(server, bad))
    assert chunk.error.code is ErrorCode.INVALID_ARGUMENT and "regex" in chunk.error.message


def test_constrained_request_through_the_server(server, tokenizer):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=3)
    chunks = asyncio.run(collect(server, request("json", "Order: ", tokenizer, params, grammar=spec)))
    assert chunks[-1].finish_reason == "stop"
    tokens = [t for c in chunks for t in c.token_ids]
    assert check_output(spec, tokenizer.decode(tokens, skip_special_tokens=True)) is None


def test_a_failing_step_ends_every_stream_with_an_error(server, tokenizer, monkeypatch):
    real_step = server.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    monkeypatch.setattr(server.engine, "step", flaky_step)

    async def main():
        return await asyncio.gather(*(collect(server, request(f"f{i}", "Order: ", tokenizer, LONG)) for i in range(3)))

    for chunks in asyncio.run(main()):
        assert chunks[-1].error.code is ErrorCode.INTERNAL and "simulated" in chunks[-1].error.message
    ok = asyncio.run(collect(server, request("after", "Order: ", tokenizer)))  # the replica keeps serving
    assert ok[-1].finish_reason == "length"


def test_a_dead_engine_loop_fails_streams_and_health(server, tokenizer, monkeypatch):
    def broken() -> bool:
        raise RuntimeError("loop bug")

    async def main():
        gen = server.generate(request("d", "Order: ", tokenizer, LONG))
        first = await anext(gen)
        monkeypatch.setattr(server.engine, "has_unfinished", broken)
        rest = [c async for c in gen]
        return [first, *rest]

    chunks = asyncio.run(asyncio.wait_for(main(), 30))
    assert chunks[-1].error.code is ErrorCode.UNAVAILABLE
    with pytest.raises(RuntimeError, match="loop bug"):
        asyncio.run(server.health())
    (late,) = asyncio.run(collect(server, request("late", "x", tokenizer)))
    assert late.error.code is ErrorCode.UNAVAILABLE


def test_a_broken_output_handler_fails_streams_and_health_instead_of_wedging(server, tokenizer, monkeypatch):
    """The core's output goes through `_on_chunks` on the core client's thread; if that raises, the
    replica reports its core dead (Serve restarts it) and every stream ends UNAVAILABLE, rather
    than nothing reading the core's output any more while health still passes."""
    real = server._on_chunks

    def breaks_once_running(chunks):
        if any(c.usage.completion_tokens >= 3 for c in chunks):
            raise KeyError("handler bug")
        real(chunks)

    monkeypatch.setattr(server.core, "on_message", breaks_once_running)
    chunks = asyncio.run(collect(server, request("b", "Order: ", tokenizer, LONG), timeout=30))
    assert chunks[-1].error.code is ErrorCode.UNAVAILABLE and "handler bug" in chunks[-1].error.message
    with pytest.raises(RuntimeError, match="handler bug"):
        asyncio.run(server.health())


def test_backpressure_and_deadline(folder, tokenizer):
    srv = make_server(folder, tokenizer, max_num_seqs=1, queued=0)
    try:
        async def main():
            first = srv.generate(request("busy", "Order: ", tokenizer, LONG))
            await anext(first)
            (refused,) = await collect(srv, request("more", "x", tokenizer))
            await first.aclose()
            return refused

        refused = asyncio.run(main())
        assert refused.error.code is ErrorCode.RESOURCE_EXHAUSTED
        wait_idle(srv)
        started = time.perf_counter()
        assert asyncio.run(collect(srv, request("full", "x", tokenizer, LONG)))[-1].finish_reason == "length"
        full = time.perf_counter() - started  # a deadline well inside this cannot be met, however fast the machine
        chunks = asyncio.run(collect(srv, request("slow", "x", tokenizer, LONG, timeout_s=full / 5)))
        assert chunks[-1].error.code is ErrorCode.DEADLINE_EXCEEDED
    finally:
        srv.shutdown()


def test_stream_interval_grows_with_the_live_requests():
    cfg = EngineSection(max_num_seqs=5, stream_interval_s=0.02, stream_interval_max_s=0.1)
    assert [round(cfg.stream_interval(n), 4) for n in (0, 1, 3, 5, 50)] == [0.02, 0.02, 0.06, 0.1, 0.1]
    assert EngineSection(stream_interval_s=0.03, stream_interval_max_s=0.03).stream_interval(40) == 0.03  # fixed
    assert EngineSection(stream_interval_s=0.05, stream_interval_max_s=0.01).stream_interval(40) == 0.05  # max below
    with pytest.raises(ValueError, match="stream_interval"):
        EngineSection(stream_interval_s=-0.05)


def test_chunks_coalesce_after_the_first_token(folder, tokenizer):
    """With an interval, later tokens arrive in fewer, larger chunks; the first is alone (TTFT
    is not delayed) and the text is the same as when every step is its own chunk."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    runs = {}
    for interval in (0.0, 0.05):
        srv = make_server(folder, tokenizer, stream_interval_s=interval)
        try:
            runs[interval] = asyncio.run(collect(srv, request("c", "Order: ", tokenizer, params)))
        finally:
            srv.shutdown()
    plain, coalesced = runs[0.0], runs[0.05]
    assert len(coalesced) < 30  # ~2-5 ms steps: 60 tokens take well under 30 intervals of 50 ms
    assert len(coalesced[0].token_ids) == 1
    assert [t for c in coalesced for t in c.token_ids] == [t for c in plain for t in c.token_ids]
    assert coalesced[-1].usage.completion_tokens == 60 and coalesced[-1].finish_reason == "length"


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_direct_streams_equal_the_served_ones_many_on_one_socket_with_cancellations(folder, tokenizer):
    """Tokens on the replica's token socket (deployments/token_channel.py; an in-process stand-in for
    Serve's streaming handle calls `generate_direct`): 12 requests share the gateway's one
    connection; 4 are abandoned mid-stream (their requests abort); every other stream gets exactly
    the tokens the Serve path gives it, none of another's."""
    prompts = ["Order: ", "The bakery sells", "Hello my", "Tomorrow we", "Please send", "A cake"] * 2
    cut = set(random.Random(3).sample(range(len(prompts)), 4))
    server, client = make_server(folder, tokenizer, max_num_seqs=4, queued=16), TokenClient()

    async def one(i: int, p: str):
        got = []
        async for chunk in client.generate(handle(server), request(f"d{i}", p, tokenizer, LONG if i in cut else GREEDY)):
            got.append(chunk)
            if i in cut and len(tokens(got)) >= 3:
                break  # the client went away
        return got

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        reference = [tokens(asyncio.run(collect(server, request(f"ref{i}", p, tokenizer)))) for i, p in enumerate(prompts)]
        results = asyncio.run(main())
        wait_idle(server)
        assert not server.engine.has_unfinished()
        assert asyncio.run(server.stats())["finished"].get("abort") == len(cut)
    finally:
        server.shutdown()
        client.close()
    for i, got in enumerate(results):
        if i in cut:
            assert not got[-1].finished and len(tokens(got)) >= 3
        else:
            assert tokens(got) == reference[i] and got[-1].finish_reason == "length", got
            assert got[-1].usage.completion_tokens == len(reference[i])


def test_a_refusal_comes_on_the_serve_call_and_a_closed_socket_ends_streams_unavailable(folder, tokenizer):
    """Direct: a refusal at admission comes on the Serve call; the replica's socket closing mid-stream
    ends its streams with a retryable UNAVAILABLE (the gateway resumes those)."""
    server = make_server(folder, tokenizer, max_num_seqs=1, queued=0)
    client, h = TokenClient(), handle(server)

    async def main():
        async def first():
            return [c async for c in client.generate(h, request("long", "Order: ", tokenizer, LONG))]

        task = asyncio.ensure_future(first())
        await asyncio.sleep(0.5)
        full = [c async for c in client.generate(h, request("more", "Hello", tokenizer))]
        server.tokens.close()  # the replica's socket goes away mid-stream (its process died)
        return full, await asyncio.wait_for(task, 30)

    try:
        full, cut = asyncio.run(main())
    finally:
        server.shutdown()
        client.close()
    assert len(full) == 1 and full[0].error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert 0 < len(tokens(cut)) < LONG.max_tokens
    assert cut[-1].error.code is ErrorCode.UNAVAILABLE and cut[-1].error.retryable


def test_a_gateway_that_dies_mid_stream_leaves_the_replica_serving_the_others(folder, tokenizer):
    """Gateway A's process dies mid-stream (its connection drops): the replica aborts A's requests
    when their chunks cannot be sent, and gateway B's streams, before and after, get every token."""
    server, a, b = make_server(folder, tokenizer, max_num_seqs=4, queued=8), TokenClient(), TokenClient()
    h = handle(server)

    async def main():
        async def on_a():
            got = []
            async for chunk in a.generate(h, request("a", "Order: ", tokenizer, LONG)):
                got.append(chunk)
                if len(tokens(got)) >= 3 and a._conns:
                    a.close()  # as if A's process died: its socket closes, nobody reads A's chunks
            return got

        task = asyncio.ensure_future(on_a())
        during = [c async for c in b.generate(h, request("b1", "Hello my", tokenizer))]
        cut = await asyncio.wait_for(task, 30)
        await asyncio.sleep(0.2)
        after = [c async for c in b.generate(h, request("b2", "The bakery sells", tokenizer))]
        return cut, during, after

    try:
        reference = [tokens(asyncio.run(collect(server, request(f"r{i}", p, tokenizer))))
                     for i, p in enumerate(["Hello my", "The bakery sells"])]
        cut, during, after = asyncio.run(asyncio.wait_for(main(), 60))
        wait_idle(server)
        assert not server.engine.has_unfinished()
        assert asyncio.run(server.stats())["finished"].get("abort") == 1
        assert asyncio.run(server.health())["status"] == "ok"
    finally:
        server.shutdown()
        a.close()
        b.close()
    assert cut[-1].error.code is ErrorCode.UNAVAILABLE and tokens(cut)
    assert tokens(during) == reference[0] and tokens(after) == reference[1]
