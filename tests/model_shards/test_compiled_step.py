"""The compiled decode/verify graph against the eager forward: the same logits (fp32 tolerance) for
every model family, the same greedy tokens through the engine, speculation included, and the same
expert-load counts (real tokens only, never the padding row)."""

from __future__ import annotations

import pytest
import torch

from bench.tiny_checkpoint import save_tiny_checkpoint
from model_shards import PagedKVCache, load_checkpoint, moe
from model_shards.compiled_step import CompiledStep
from model_shards.kv_cache import StepBatch
from moeserve.engine import LLMEngine, ModelRunner, SpecConfig
from moeserve.sampling_params import SamplingParams
from moeserve.spec.ngram import NgramProposer
from tests.model_shards.hf_tiny import save_tiny

BLOCKS, BS = 48, 4
# four rows' blocks, scattered and interleaved: row r holds 2 + r, 7 + r, 12 + r, ...
TABLES = torch.tensor([[2 + r + 5 * i for i in range(8)] for r in range(4)])  # [4, 8]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own graphs: dynamo keys its cache by code object, so graphs of the
    previous tests' models would count toward its recompile limit (past it, it runs eagerly)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def cache_of(model) -> PagedKVCache:
    return PagedKVCache.for_model(model.config, BLOCKS, BS)


def batch(rows: list[int], start: list[int], q_lens: list[int]) -> StepBatch:
    return StepBatch(TABLES[rows], torch.tensor(start), torch.tensor(q_lens), BS)


def prefilled(model, lengths: list[int], n: int = 2) -> list[PagedKVCache]:
    """`n` caches holding the same random prompt of each length in rows 0, 1, ... (eager)."""
    ids = torch.randint(2, model.config.vocab_size, (len(lengths), max(lengths)),
                        generator=torch.Generator().manual_seed(1))
    caches = [cache_of(model) for _ in range(n)]
    for cache in caches:
        model(ids, cache, batch(list(range(len(lengths))), [0] * len(lengths), lengths), logits="last")
    return caches


def assert_same_cache(got: PagedKVCache, want: PagedKVCache) -> None:
    """Every block but the scratch one (which padding writes) as the other wrote it."""
    for a, b in zip(got.kv, want.kv):
        torch.testing.assert_close(a[:, :, 1:], b[:, :, 1:])


STEPS = (([1], [3], [1], 1), ([0, 1, 2], [7, 3, 11], [1, 1, 1], 1), ([2, 0, 1], [12, 8, 4], [4, 2, 3], 4))


@pytest.mark.parametrize("experts", ["routed", "dense"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama", "deepseek_v3"])
def test_the_graph_computes_the_eager_forward(tmp_path, family, experts, monkeypatch):
    """The rewritten pass (traced by dynamo, run without inductor) for every family: shared
    experts, dense layers, q/k norms, qkv clipping, latent attention; decode rows and verify rows, ragged, through
    scattered blocks. Experts routed always (small experts), or dense wherever N * K > E (as for
    experts too big for the caches). The graph writes the cache as eager does."""
    if experts == "dense":
        monkeypatch.setattr(moe, "ROUTED_MAX_EXPERT_BYTES", 0)
    save_tiny(family, tmp_path)
    model = load_checkpoint(tmp_path)
    eager, graph = prefilled(model, [7, 3, 11])
    step = CompiledStep(model, graph, backend="eager")
    for rows, start, q_lens, t in STEPS:
        ids = torch.randint(2, model.config.vocab_size, (len(rows), t))
        want = model(ids, eager, batch(rows, start, q_lens), logits="all")  # [B, T, V]
        got = step(ids, TABLES[rows], start, q_lens)
        assert step.num_calls > 0
        for b, n in enumerate(q_lens):  # padding positions are never read
            torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-5)
    assert_same_cache(graph, eager)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_inductor_computes_the_eager_forward(tmp_path, family):
    """The same passes compiled by inductor for real (plain and latent attention)."""
    save_tiny(family, tmp_path)
    model = load_checkpoint(tmp_path)
    eager, graph = prefilled(model, [7, 3, 11])
    step = CompiledStep(model, graph)
    for rows, start, q_lens, t in STEPS:
        ids = torch.randint(2, model.config.vocab_size, (len(rows), t))
        want = model(ids, eager, batch(rows, start, q_lens), logits="all")
        got = step(ids, TABLES[rows], start, q_lens)
        for b, n in enumerate(q_lens):
            torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-5)
    assert_same_cache(graph, eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


@pytest.mark.parametrize("experts", ["small", "large"])
def test_warm_up_compiles_every_graph_a_batch_needs(tmp_path, experts, monkeypatch):
    """After `warm_up`, decode batches of any size run without compiling: small experts take one
    graph for 2+ rows (the size test must not guard on N); experts too big for the caches take a
    routed graph up to E / K tokens and a dense one past it, both warmed."""
    if experts == "large":
        monkeypatch.setattr(moe, "ROUTED_MAX_EXPERT_BYTES", 0)
    save_tiny("mixtral", tmp_path)
    model = load_checkpoint(tmp_path)
    step = CompiledStep(model, cache_of(model), backend="eager")
    step.warm_up((1,))
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled == (2 if experts == "small" else 3)
    for rows in range(1, len(TABLES) + 1):
        step(torch.ones(rows, 1, dtype=torch.long), TABLES[:rows], [5] * rows, [1] * rows)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled


def test_static_buckets_pad_rows_and_blocks_without_touching_other_blocks(tmp_path):
    """The GPU's fixed-shape graphs (here traced on the CPU) over the paged cache: 3 rows padded
    to 4, block tables padded to a power of two with the scratch block; the real rows' logits
    are eager's, and the padding writes nothing but the scratch block."""
    from model_shards.compiled_step import CAPTURE_SIZES

    save_tiny("mixtral", tmp_path)
    model = load_checkpoint(tmp_path)
    eager, graph = prefilled(model, [7, 3, 11, 5])
    step = CompiledStep(model, graph, backend="eager", static=True)
    assert step.accepts(3, 1) and step.accepts(CAPTURE_SIZES[-1], 5) and not step.accepts(CAPTURE_SIZES[-1] + 1, 1)
    for rows, start, q_lens, t in (([1, 2, 3], [3, 11, 5], [1, 1, 1], 1), ([2], [12], [3], 3)):
        ids = torch.randint(2, model.config.vocab_size, (len(rows), t))
        want = model(ids, eager, batch(rows, start, q_lens), logits="all")
        got = step(ids, TABLES[rows, :4], start, q_lens)
        assert got.shape == want.shape
        for b, n in enumerate(q_lens):
            torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-5)
    assert_same_cache(graph, eager)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


def engine(folder, compiled: bool, speculate: bool = False) -> LLMEngine:
    runner = ModelRunner(load_checkpoint(folder), 8, 256, num_blocks=200, block_size=4, compile=compiled)
    if speculate:
        return LLMEngine(runner, proposer=NgramProposer(), spec=SpecConfig(num_tokens=3))
    return LLMEngine(runner)


def test_compiled_engine_writes_the_eager_tokens_and_counts_the_same_load(tiny):
    """Inductor for real: greedy tokens identical to eager, with and without n-gram drafts (verify
    passes of k + 1 positions), a batch of one and of five (two sharing a prompt prefix: a prefix
    hit, then a short prefill), and identical expert-load counts."""
    prompts = [[5, 9, 13, 9, 13, 9], [7, 7, 8], [11, 3, 11, 3, 11, 3, 11], [4], [5, 9, 13, 9, 13, 9, 2]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for speculate in (False, True):
        runs = {}
        for compiled in (False, True):
            eng = engine(tiny, compiled, speculate)
            stats = eng.runner.model.enable_stats()
            solo = eng.generate(prompts[:1], params)  # a batch of one
            together = eng.generate(prompts, params)
            runs[compiled] = ([c.token_ids for c in solo + together], stats.route_counts.clone())
            if compiled:  # the decode and verify passes of both batches went through the graph
                assert eng.runner.compiled.num_calls >= 2 * (params.max_tokens - 1) // (4 if speculate else 1)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not run eagerly
        assert runs[True][0] == runs[False][0]
        assert torch.equal(runs[True][1], runs[False][1])


def test_the_phase_timer_does_not_break_the_graph(tmp_path, monkeypatch):
    """The layer code's phases (bench.expert_parallel's split) are no-ops inside a graph: timing a
    compiled pass neither breaks its graph nor compiles another."""
    save_tiny("mixtral", tmp_path)
    model = load_checkpoint(tmp_path)
    eager, graph = prefilled(model, [7, 3, 11])
    step = CompiledStep(model, graph, backend="eager")
    rows, start, q_lens, t = STEPS[0]
    ids = torch.randint(2, model.config.vocab_size, (len(rows), t))
    step(ids, TABLES[rows], start, q_lens)
    monkeypatch.setattr(moe.TIMER, "enabled", True)
    step(ids, TABLES[rows], start, q_lens)
    stats = torch._dynamo.utils.counters
    assert not stats["graph_break"] and stats["stats"]["unique_graphs"] == 1
