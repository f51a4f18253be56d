"""The engine core in a process of its own: the same tokens as the thread core, and a core killed
mid-stream costs the client nothing (the replica restarts it, the gateway resumes every stream)."""

from __future__ import annotations

import asyncio
import os

import pytest

from bench.oracle import check_output
from bench.tiny_checkpoint import save_tiny_checkpoint
from deployments.engine_server import EngineServer
from deployments.frontend import Frontend, ServeRequest
from deployments.metrics import GatewayMetrics
from moeserve.config import AppConfig
from moeserve.engine.llm import LLM
from moeserve.errors import ErrorCode
from moeserve.grammar import GrammarSpec
from moeserve.protocol import GenerateRequest
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import load_tokenizer

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
GREEDY_FIELDS = {"temperature": 0.0, "ignore_eos": True}  # GREEDY as a ServeRequest asks for it
PROMPTS = ["order status please", "The bakery sells", "Hello my", "Tomorrow we"]

def tree(model_name: str, max_model_len: int, **gateway) -> AppConfig:
    """The config tree a frontend serving `model_name` takes (gateway: that section's settings)."""
    return AppConfig.from_dict({"model": {"name": model_name}, "engine": {"max_model_len": max_model_len},
                                "gateway": gateway})


def served(folder: str, speculative: dict | None = None, **engine) -> AppConfig:
    """The config tree of an engine replica on `folder`: a 4-sequence batch, one torch thread, every
    step's tokens a chunk of their own."""
    engine = {"max_num_seqs": 4, "max_model_len": 256, "torch_threads": 1, "stream_interval_s": 0,
              "stream_interval_max_s": 0, **engine}
    return AppConfig.from_dict({"model": {"path": folder}, "engine": engine,
                                "speculative": speculative or {"draft": "none"}})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe")))


@pytest.fixture(scope="module")
def server(folder):
    srv = EngineServer(served(folder))
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def expected(folder):
    """Fault-free greedy tokens, from the offline API in this process."""
    llm = LLM(folder, draft="none", max_num_seqs=4, max_model_len=256)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def frontend(server: EngineServer, folder: str) -> Frontend:
    return Frontend(tree("tiny", 256), load_tokenizer(folder), server, GatewayMetrics())


async def stream_all(fe: Frontend, grammar=None, on_first=None) -> list[list]:
    async def one(prompt: str):
        (prep,) = fe.prepare(ServeRequest("tiny", prompt, max_tokens=40, sampling=GREEDY_FIELDS, grammar=grammar), "t")
        chunks = []
        async for chunk in fe.stream(prep):
            chunks.append(chunk)
            if on_first is not None and len(chunks) == 3:
                on_first()
        return chunks

    return await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 120)


def test_the_core_runs_in_its_own_process_and_matches_the_offline_engine(server, folder, expected):
    assert server.engine is None and server.core.pid not in (None, os.getpid())
    outs = asyncio.run(stream_all(frontend(server, folder)))
    assert [[t for c in chunks for t in c.token_ids] for chunks in outs] == expected
    assert all(chunks[-1].finish_reason == "length" for chunks in outs)
    stats = asyncio.run(server.stats())
    assert stats["steps"] > 0 and stats["live_requests"] == 0 and stats["running"] == 0


def test_a_grammar_is_compiled_in_the_core_and_a_bad_one_is_invalid_argument(server, folder):
    fe = frontend(server, folder)
    spec = GrammarSpec.regex("[a-z]{3,12}( [a-z]{2,8}){2,5}")
    outs = asyncio.run(stream_all(fe, spec))
    for chunks in outs:
        assert chunks[-1].finish_reason == "stop" and check_output(spec, "".join(c.text for c in chunks)) is None

    async def bad():
        req = GenerateRequest("bad", tuple(fe.tokenizer.encode("x")), GREEDY, GrammarSpec.regex("(["))
        return [c async for c in server.generate(req)]

    (chunk,) = asyncio.run(bad())
    assert chunk.error.code is ErrorCode.INVALID_ARGUMENT and chunk.error.param == "grammar"


def test_killing_the_core_mid_stream_loses_nothing(server, folder, expected):
    fe = frontend(server, folder)
    pid_before, restarts = server.core.pid, server.core.restarts
    outs = asyncio.run(stream_all(fe, on_first=lambda: server.core.kill() if server.core.pid == pid_before else None))
    assert server.core.restarts == restarts + 1 and server.core.pid != pid_before
    assert [[t for c in chunks for t in c.token_ids] for chunks in outs] == expected
    assert all(chunks[-1].error is None for chunks in outs)
    assert fe.metrics.retries._value.get() >= 1
    assert asyncio.run(server.health())["status"] == "ok"


def test_a_paged_core_process_matches_and_reports_its_prefix_cache(folder):
    """The served core process with 4-token blocks: the same tokens as offline with 16-token
    ones, and the blocks and prefix-cache hits reach the engine's stats (and so /metrics)."""
    prompts = [f"Our shop in Pune. {p} " * 3 for p in PROMPTS]
    llm = LLM(folder, draft="none", max_num_seqs=4, max_model_len=256)
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    srv = EngineServer(served(folder, block_size=4))
    try:
        fe = frontend(srv, folder)

        async def run() -> list[list[int]]:
            async def one(prompt: str) -> list[int]:
                (prep,) = fe.prepare(ServeRequest("tiny", prompt, max_tokens=40, sampling=GREEDY_FIELDS), "t")
                return [t async for c in fe.stream(prep) for t in c.token_ids]
            return list(await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120))

        assert asyncio.run(run()) == expected
        assert asyncio.run(run()) == expected  # now from the prefix cache
        stats = asyncio.run(srv.stats())
        kv = stats["kv"]
        assert kv["prefix_cache_hit_tokens"] > 0 and kv["kv_blocks_free"] == kv["kv_blocks_total"]
        text = GatewayMetrics().render(stats).decode()
        assert 'moeserve_engine{name="kv_prefix_cache_hit_rate"}' in text
    finally:
        srv.shutdown()


def test_a_core_process_drafts_over_the_draft_deployments_channel(folder, expected):
    """With a draft deployment the core still runs in its own process: the replica hands the core a
    proposer on the draft worker's channel (deployments/app.py asks the deployment for it), which
    drafts every step there, and writes the target's greedy tokens (the target is its own draft
    here, so every draft is accepted)."""
    from deployments.draft import DraftProcess
    from deployments.draft_worker import DraftServerConfig

    draft = DraftProcess(DraftServerConfig(folder, max_num_seqs=4, max_model_len=256, torch_threads=1))
    speculative = {"draft": "model", "draft_path": folder, "num_tokens": 4, "adaptive": False}
    srv = EngineServer(served(folder, speculative=speculative), draft=(draft.address, draft.authkey))
    try:
        assert srv.engine is None and srv.core.pid not in (None, os.getpid())
        outs = asyncio.run(stream_all(frontend(srv, folder)))
        assert [[t for c in chunks for t in c.token_ids] for chunks in outs] == expected
        stats = asyncio.run(srv.stats())
        assert stats["spec"]["alpha"] == 1.0, stats["spec"]
        assert stats["draft"]["calls"] > 0 and stats["draft"]["fallback_steps"] == 0
        assert stats["draft"]["predraft_hits"] > 0, stats["draft"]
        assert draft.stats()["calls"] == stats["draft"]["calls"]
    finally:
        srv.shutdown()
        draft.close()
