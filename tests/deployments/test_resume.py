"""Nothing accepted is lost: a stream whose engine replica is lost mid-stream resumes on a fresh
attempt with the tokens already delivered, and the client sees exactly the uninterrupted output;
a request that breaks every step it is in fails alone, and its neighbours never notice."""

from __future__ import annotations

import asyncio

import pytest

from bench.oracle import check_output
from bench.tiny_checkpoint import save_tiny_checkpoint
from deployments.engine_server import EngineServer
from deployments.frontend import Frontend, ServeRequest
from deployments.metrics import GatewayMetrics
from deployments.token_channel import TokenClient
from model_shards import load_checkpoint
from moeserve.config import AppConfig
from moeserve.engine import LLMEngine, ModelRunner
from moeserve.engine.core import EngineCore
from moeserve.errors import ErrorCode, ServingError
from moeserve.grammar import GrammarSpec
from moeserve.protocol import GenerateRequest, Shutdown
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import load_tokenizer
from tests.deployments.serve_stand_in import handle

GREEDY = {"temperature": 0.0, "ignore_eos": True}  # and max_tokens 24

def tree(model_name: str, max_model_len: int, **gateway) -> AppConfig:
    """The config tree a frontend serving `model_name` and its engine replica take (gateway: that
    section's settings); every step's tokens are a chunk of their own (DroppingReplica counts them)."""
    engine = {"max_model_len": max_model_len, "stream_interval_s": 0, "stream_interval_max_s": 0}
    return AppConfig.from_dict({"model": {"name": model_name}, "engine": engine, "gateway": gateway})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


class DroppingReplica:
    """The engine replica as the gateway reaches it, whose first call drops after `fail_at`
    chunks, as when the replica (or the core under it) dies mid-stream."""

    def __init__(self, server: EngineServer, fail_at: int) -> None:
        self.server, self.fail_at, self.calls = server, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.server, name)

    async def generate(self, request):
        self.calls += 1
        chunks = self.server.generate(request)
        try:
            n = 0
            async for chunk in chunks:
                yield chunk
                n += 1
                if self.calls == 1 and n == self.fail_at:
                    raise ConnectionError("replica connection lost")
        finally:
            await chunks.aclose()


class DroppingSocket:
    """The engine replica as a gateway with `gateway.direct_tokens` reaches it: a Serve call admits
    the request and the tokens come on the replica's token socket, which drops after the first
    call's `fail_at` chunks, as when the replica's process dies mid-stream."""

    def __init__(self, server: EngineServer, fail_at: int) -> None:
        self.server, self.fail_at, self.calls = server, fail_at, 0
        self.client, self.handle = TokenClient(), handle(server)

    def __getattr__(self, name):
        return getattr(self.server, name)

    async def generate(self, request):
        self.calls += 1
        n = 0
        async for chunk in self.client.generate(self.handle, request):
            yield chunk
            n += 1
            if self.calls == 1 and n == self.fail_at:
                self.client.close()  # the connection drops; the reader ends the stream UNAVAILABLE


class PoisonRunner:
    """A model runner whose every forward with the token POISON in its rows raises: one request
    breaks any batch it is in."""

    POISON = 7

    def __init__(self, runner: ModelRunner) -> None:
        self.inner = runner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, rows, logits="last"):
        if any(self.POISON in r.tokens for r in rows):
            raise RuntimeError("NaN in the attention scores")
        return self.inner.forward(rows, logits)


def run(folder, fail_at: int | None, grammar: GrammarSpec | None = None, retries: int = 2, drop=DroppingReplica):
    tokenizer = load_tokenizer(folder)
    server = EngineServer(tree("tiny", 256), engine=LLMEngine(ModelRunner(load_checkpoint(folder), 4, 256), tokenizer))
    metrics = GatewayMetrics()
    replica = drop(server, fail_at) if fail_at else server
    frontend = Frontend(tree("tiny", 256, max_retries=retries), tokenizer, replica, metrics)

    async def go():
        (prep,) = frontend.prepare(ServeRequest("tiny", "order status please", max_tokens=24, sampling=GREEDY,
                                                grammar=grammar), "t")
        return await collect(frontend.stream(prep))

    try:
        chunks, error = asyncio.run(go())
    finally:
        server.shutdown()
    tokens = [t for c in chunks for t in c.token_ids]
    return tokens, "".join(c.text for c in chunks), chunks[-1], error, metrics


async def collect(stream) -> tuple[list, ServingError | None]:
    """A stream's chunks, and the error that ended it (None: it finished)."""
    chunks = []
    try:
        async for chunk in stream:
            chunks.append(chunk)
    except ServingError as e:
        return chunks, e
    return chunks, None


@pytest.mark.parametrize("drop", [DroppingReplica, DroppingSocket])
@pytest.mark.parametrize("grammar", [None, GrammarSpec.regex("[a-z]{3,20}( [a-z]{2,9}){2,6}")])
def test_failed_step_mid_stream_is_resumed_without_loss(folder, grammar, drop):
    """On the Serve call (DroppingReplica) and on the direct token socket (DroppingSocket)."""
    expected, text, _, error, _ = run(folder, None, grammar)
    assert error is None and len(expected) > 6
    tokens, text2, last2, error2, metrics = run(folder, fail_at=5, grammar=grammar, drop=drop)  # 5 chunks, then gone
    assert tokens == expected and text2 == text
    assert error2 is None and last2.usage.completion_tokens == len(expected)
    assert metrics.retries._value.get() == 1
    if grammar is not None:
        assert check_output(grammar, text2) is None


def test_without_retries_the_client_gets_a_clear_error(folder):
    tokens, _, _, error, _ = run(folder, fail_at=5, retries=0)
    assert error.code is ErrorCode.UNAVAILABLE and "replica connection lost" in error.message
    assert 0 < len(tokens) < 24


def test_a_poisoned_request_fails_alone_and_its_neighbours_carry_on(folder):
    """Four requests in one batch, one of which breaks every step it is in: it ends with INTERNAL
    after running alone; the other three end with exactly their fault-free tokens, no retry used."""
    tokenizer = load_tokenizer(folder)
    prompts = [tokenizer.encode(p) for p in ("order status please", "the bakery sells", "hello my friend")]
    poisoned = [5, PoisonRunner.POISON, 9, 11]
    params = {"temperature": 0.0, "ignore_eos": True}

    def serve(runner):
        server = EngineServer(tree("tiny", 256), engine=LLMEngine(runner, tokenizer))
        frontend = Frontend(tree("tiny", 256), tokenizer, server, GatewayMetrics())

        async def one(ids):
            (prep,) = frontend.prepare(ServeRequest("tiny", ids, max_tokens=16, sampling=params), "t")
            return await collect(frontend.stream(prep))

        async def all_of(batch):
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in batch)), 120)

        try:
            return asyncio.run(all_of(prompts + [poisoned])), frontend.metrics, server
        finally:
            server.shutdown()

    clean, _, _ = serve(ModelRunner(load_checkpoint(folder), 4, 256))
    outs, metrics, server = serve(PoisonRunner(ModelRunner(load_checkpoint(folder), 4, 256)))
    for (good, _), (got, error) in zip(clean[:3], outs[:3]):
        assert error is None and [t for c in got for t in c.token_ids] == [t for c in good for t in c.token_ids]
    _, poisoned = outs[3]
    assert poisoned.code is ErrorCode.INTERNAL and "alone" in poisoned.message
    assert metrics.retries._value.get() == 0  # nobody resumed: the neighbours never saw an error, and the
    # poisoned request's error said a fresh attempt would fail the same way (INTERNAL is resumable otherwise)


class ScriptChannel:
    """A core's channel fed with a fixed list of messages; it shuts the core down once idle."""

    def __init__(self, messages: list) -> None:
        self.inbox, self.sent = list(messages), []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def recv(self, timeout):
        if self.inbox:
            return self.inbox.pop(0)
        return Shutdown() if timeout else None  # the core only waits when it has nothing to do


def test_the_core_bisects_a_failed_batch(folder):
    """All four requests reach the core before its first step, so they prefill as one batch: that
    step fails, each runs alone, the poisoned one fails alone twice, the others finish exactly."""
    tokenizer = load_tokenizer(folder)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 8], [5, PoisonRunner.POISON, 9], [10, 11], [12, 13, 14, 15]]
    clean = LLMEngine(ModelRunner(load_checkpoint(folder), 4, 256), tokenizer).generate(prompts, params)
    core = EngineCore(LLMEngine(PoisonRunner(ModelRunner(load_checkpoint(folder), 4, 256)), tokenizer))
    channel = ScriptChannel([GenerateRequest(f"r{i}", tuple(p), params) for i, p in enumerate(prompts)])
    core.run(channel)
    chunks = [c for msg in channel.sent if isinstance(msg, list) for c in msg]
    for i in (0, 2, 3):
        mine = [c for c in chunks if c.request_id == f"r{i}"]
        assert [t for c in mine for t in c.token_ids] == clean[i].token_ids and mine[-1].finish_reason == "length"
    (poisoned,) = [c for c in chunks if c.request_id == "r1"]
    assert poisoned.error.code is ErrorCode.INTERNAL and not poisoned.error.retryable
    assert core.counters["step_errors"] == 3 and core.counters["isolated_failures"] == 1  # the batch, then twice alone
