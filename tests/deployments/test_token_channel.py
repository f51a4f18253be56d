"""Tokens from the engine replica straight to the gateway (deployments/token_channel.py), without Ray:
an in-process stand-in for Serve's streaming handle calls `EngineServer.generate_direct`."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from bench.tiny_checkpoint import save_tiny_checkpoint
from deployments.token_channel import TokenClient
from moeserve.errors import ErrorCode
from moeserve.tokenizer import load_tokenizer
from tests.deployments.test_engine_server import GREEDY, LONG, collect, make_server, request, wait_idle


class _Call:
    """A streaming Serve call's response: iterate it; `cancel()` closes the replica's generator."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self.agen)

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())


def handle(server):
    return SimpleNamespace(generate_direct=SimpleNamespace(remote=lambda *args: _Call(server.generate_direct(*args))))


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_tokenizer(folder)


@pytest.fixture
def server(folder, tokenizer):
    srv = make_server(folder, tokenizer, max_num_seqs=4, queued=16)
    yield srv
    srv.shutdown()


def test_direct_streams_equal_the_served_ones_many_on_one_socket_with_cancellations(server, tokenizer):
    """12 requests share the gateway's one connection; 4 are abandoned mid-stream (their requests
    abort); every other stream gets exactly the tokens the Serve path gives it, none of another's."""
    prompts = ["Order: ", "The bakery sells", "Hello my", "Tomorrow we", "Please send", "A cake"] * 2
    reference = [tokens(asyncio.run(collect(server, request(f"ref{i}", p, tokenizer)))) for i, p in enumerate(prompts)]
    client = TokenClient()
    h = handle(server)
    cut = set(random.Random(3).sample(range(len(prompts)), 4))

    async def one(i: int, p: str):
        got = []
        async for chunk in client.generate(h, request(f"d{i}", p, tokenizer, LONG if i in cut else GREEDY)):
            got.append(chunk)
            if i in cut and len(tokens(got)) >= 3:
                break  # the client went away
        return got

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    for i, got in enumerate(results):
        if i in cut:
            assert not got[-1].finished and len(tokens(got)) >= 3
        else:
            assert tokens(got) == reference[i] and got[-1].finish_reason == "length", got
            assert got[-1].usage.completion_tokens == len(reference[i])
    wait_idle(server)
    assert not server.engine.has_unfinished()
    assert asyncio.run(server.stats())["finished"].get("abort") == len(cut)
    client.close()


def test_a_refusal_comes_on_the_serve_call_and_a_closed_socket_ends_streams_unavailable(folder, tokenizer):
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
