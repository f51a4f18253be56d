"""Nothing accepted is lost: a stream whose engine step fails resumes on a fresh attempt
with the tokens already delivered, and the client sees exactly the uninterrupted output."""

from __future__ import annotations

import asyncio

import pytest

from deployments.engine_server import EngineServer, EngineServerConfig
from deployments.frontend import Frontend, FrontendConfig
from deployments.metrics import GatewayMetrics
from model_shards import load_checkpoint
from moeserve.engine import LLMEngine, ModelRunner
from moeserve.grammar import GrammarSpec, check_output
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import load_tokenizer
from tests.deployments.tiny_checkpoint import save_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


class FlakyRunner:
    """A model runner whose `fail_at`-th forward raises, like a shard group losing a rank."""

    def __init__(self, runner: ModelRunner, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = runner, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, rows, logits="last"):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("Connection closed by peer (shard 1)")
        return self.inner.forward(rows, logits)


def run(folder, fail_at: int | None, grammar: GrammarSpec | None = None, retries: int = 2):
    tokenizer = load_tokenizer(folder)
    runner = ModelRunner(load_checkpoint(folder), 4, 256)
    server = EngineServer(EngineServerConfig(), engine=LLMEngine(
        FlakyRunner(runner, fail_at) if fail_at else runner, tokenizer))
    metrics = GatewayMetrics()
    frontend = Frontend(FrontendConfig("tiny", 256, max_retries=retries), tokenizer, server, metrics)

    async def go():
        prep = await frontend.prepare(tokenizer.encode("order status please"), lambda n: GREEDY, 24, grammar, "t")
        return [c async for c in frontend.stream(prep)]

    try:
        chunks = asyncio.run(go())
    finally:
        server.shutdown()
    tokens = [t for c in chunks for t in c.token_ids]
    return tokens, "".join(c.text for c in chunks), chunks[-1], metrics


@pytest.mark.parametrize("grammar", [None, GrammarSpec.regex("[a-z]{3,20}( [a-z]{2,9}){2,6}")])
def test_failed_step_mid_stream_is_resumed_without_loss(folder, grammar):
    expected, text, last, _ = run(folder, None, grammar)
    assert last.error is None and len(expected) > 6
    tokens, text2, last2, metrics = run(folder, fail_at=5, grammar=grammar)  # prefill + 3 decode steps, then boom
    assert tokens == expected and text2 == text
    assert last2.error is None and last2.usage.completion_tokens == len(expected)
    assert metrics.retries._value.get() == 1
    if grammar is not None:
        assert check_output(grammar, text2) is None


def test_without_retries_the_client_gets_a_clear_error(folder):
    tokens, _, last, _ = run(folder, fail_at=5, retries=0)
    assert last.error is not None and "engine step failed" in last.error.message
    assert 0 < len(tokens) < 24
