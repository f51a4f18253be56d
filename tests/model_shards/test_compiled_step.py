"""The compiled decode/verify graph against the eager forward: the same logits (fp32 tolerance) for
every model family, the same greedy tokens through the engine, speculation included, and the same
expert-load counts (real tokens only, never the padding row)."""

from __future__ import annotations

import pytest
import torch

from bench.tiny_checkpoint import save_tiny_checkpoint
from model_shards import compiled_step, load_checkpoint
from model_shards.compiled_step import CompiledStep
from model_shards.kv_cache import StepBatch
from moeserve.engine import LLMEngine, ModelRunner, SpecConfig
from moeserve.sampling_params import SamplingParams
from moeserve.spec.ngram import NgramProposer
from tests.model_shards.hf_tiny import save_tiny

SLOTS, MAX_LEN = 4, 128


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own graphs: dynamo keys its cache by code object, so graphs of the
    previous tests' models would count toward its recompile limit (past it, it runs eagerly)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def prefill(model, cache, lengths: list[int]) -> None:
    """Cache a random prompt of each length in slots 0, 1, ... (eager)."""
    ids = torch.randint(2, model.config.vocab_size, (len(lengths), max(lengths)))
    model(ids, cache, StepBatch.build(list(range(len(lengths))), [0] * len(lengths), lengths), logits="last")


@pytest.mark.parametrize("experts", ["routed", "dense"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama"])
def test_the_graph_computes_the_eager_forward(tmp_path, family, experts, monkeypatch):
    """The rewritten pass (traced by dynamo, run without inductor) for every family: shared
    experts, dense layers, q/k norms, qkv clipping; decode rows and verify rows, ragged. Experts
    routed always (small experts), or dense wherever N * K > E (as for experts too big for the caches)."""
    if experts == "dense":
        monkeypatch.setattr(compiled_step, "ROUTED_MAX_EXPERT_BYTES", 0)
    save_tiny(family, tmp_path)
    model = load_checkpoint(tmp_path)
    torch.manual_seed(0)
    eager_cache, graph_cache = model.make_cache(SLOTS, MAX_LEN), model.make_cache(SLOTS, MAX_LEN)
    for cache in (eager_cache, graph_cache):
        torch.manual_seed(1)
        prefill(model, cache, [7, 3, 11])
    step = CompiledStep(model, graph_cache, backend="eager")
    for slots, start, q_lens, t in (([1], [3], [1], 1), ([0, 1, 2], [7, 3, 11], [1, 1, 1], 1),
                                    ([2, 0], [12, 8], [4, 2], 4)):
        ids = torch.randint(2, model.config.vocab_size, (len(slots), t))
        want = model(ids, eager_cache, StepBatch.build(slots, start, q_lens), logits="all")  # [B, T, V]
        got = step(ids, slots, start, q_lens)
        assert step.num_calls > 0
        for b, n in enumerate(q_lens):  # padding positions are never read
            torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-5)
    for layer in range(model.config.num_layers):  # the graph wrote the cache in place, as eager did
        torch.testing.assert_close(graph_cache.k[layer][:, :, :16], eager_cache.k[layer][:, :, :16])


@pytest.mark.parametrize("experts", ["small", "large"])
def test_warm_up_compiles_every_graph_a_batch_needs(tmp_path, experts, monkeypatch):
    """After `warm_up`, decode batches of any size up to the cache's slots run without compiling:
    small experts take one graph for 2+ rows (the size test must not guard on N); experts too big
    for the caches take a routed graph up to E / K tokens and a dense one past it, both warmed."""
    if experts == "large":
        monkeypatch.setattr(compiled_step, "ROUTED_MAX_EXPERT_BYTES", 0)
    save_tiny("mixtral", tmp_path)
    model = load_checkpoint(tmp_path)
    step = CompiledStep(model, model.make_cache(SLOTS, MAX_LEN), backend="eager")
    step.warm_up((1,))
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled == (2 if experts == "small" else 3)
    for rows in range(1, SLOTS + 1):
        step(torch.ones(rows, 1, dtype=torch.long), list(range(rows)), [5] * rows, [1] * rows)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


def engine(folder, compiled: bool, speculate: bool = False) -> LLMEngine:
    runner = ModelRunner(load_checkpoint(folder), 4, 256, compile=compiled)
    if speculate:
        return LLMEngine(runner, proposer=NgramProposer(), spec=SpecConfig(num_tokens=3))
    return LLMEngine(runner)


def test_compiled_engine_writes_the_eager_tokens_and_counts_the_same_load(tiny):
    """Inductor for real: greedy tokens identical to eager, with and without n-gram drafts (verify
    passes of k + 1 positions), a batch of one and of four, and identical expert-load counts."""
    prompts = [[5, 9, 13, 9, 13, 9], [7, 7, 8], [11, 3, 11, 3, 11, 3, 11], [4]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for speculate in (False, True):
        runs = {}
        for compiled in (False, True):
            eng = engine(tiny, compiled, speculate)
            stats = eng.runner.model.enable_stats()
            solo = eng.generate(prompts[:1], params)  # a batch of one (padded to two in the graph)
            together = eng.generate(prompts, params)
            runs[compiled] = ([c.token_ids for c in solo + together], stats.route_counts.clone())
            if compiled:  # the decode and verify passes of both batches went through the graph
                assert eng.runner.compiled.num_calls >= 2 * (params.max_tokens - 1) // (4 if speculate else 1)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not run eagerly
        assert runs[True][0] == runs[False][0]
        assert torch.equal(runs[True][1], runs[False][1])


def test_static_buckets_pad_rows_and_keys_without_touching_other_slots(tmp_path):
    """The GPU's fixed-shape graphs (here traced on the CPU): 3 rows padded to 4, keys padded to
    a power of two; the real rows' logits are eager's, and the padding rows write nothing but
    the scratch column (every slot's cached keys stay as eager left them)."""
    from model_shards.compiled_step import CAPTURE_SIZES

    save_tiny("mixtral", tmp_path)
    model = load_checkpoint(tmp_path)
    eager_cache, graph_cache = model.make_cache(SLOTS, MAX_LEN), model.make_cache(SLOTS, MAX_LEN)
    for cache in (eager_cache, graph_cache):
        torch.manual_seed(1)
        prefill(model, cache, [7, 3, 11, 5])
    step = CompiledStep(model, graph_cache, backend="eager", static=True)
    assert step.accepts(3, 1) and step.accepts(CAPTURE_SIZES[-1], 5) and not step.accepts(CAPTURE_SIZES[-1] + 1, 1)
    for slots, start, q_lens, t in (([1, 2, 3], [3, 11, 5], [1, 1, 1], 1), ([2], [12], [3], 3)):
        ids = torch.randint(2, model.config.vocab_size, (len(slots), t))
        want = model(ids, eager_cache, StepBatch.build(slots, start, q_lens), logits="all")
        got = step(ids, slots, start, q_lens)
        assert got.shape == want.shape
        for b, n in enumerate(q_lens):
            torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-5)
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(graph_cache.k[layer][:, :, :MAX_LEN], eager_cache.k[layer][:, :, :MAX_LEN])
        torch.testing.assert_close(graph_cache.v[layer][:, :, :MAX_LEN], eager_cache.v[layer][:, :, :MAX_LEN])


def test_the_graph_over_the_paged_cache_computes_the_eager_forward(tmp_path):
    """The graph reading and writing through block tables (scattered blocks, padding rows, a verify
    pass), traced and compiled with inductor: eager's logits, and the cache written as eager wrote it."""
    from model_shards.paged_kv import PagedKVCache

    save_tiny("mixtral", tmp_path)
    model = load_checkpoint(tmp_path)
    cfg = model.config
    caches = [PagedKVCache(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, initial_blocks=16) for _ in range(2)]
    tables = torch.tensor([[3 + 5 * i for i in range(8)], [4 + 5 * i for i in range(8)], [5 + 5 * i for i in range(8)]])
    lengths = [7, 3, 11]
    ids = torch.randint(2, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    for cache in caches:  # the prompts, eagerly (the graph's cache must grow to hold block 38)
        batch = StepBatch.build([0] * 3, [0] * 3, lengths)
        batch.block_table, batch.block_size = tables, 4
        cache.reserve(int(tables.max()) + 1)
        model(ids, cache, batch, logits="last")
    eager, graph = caches
    for backend in ("eager", "inductor"):
        step = CompiledStep(model, graph, backend=backend)
        for rows, start, q_lens, t in (([1], [3], [1], 1), ([0, 1, 2], [7, 3, 11], [1, 1, 1], 1),
                                        ([2, 0, 1], [12, 8, 4], [4, 2, 3], 4)):
            step_ids = torch.randint(2, cfg.vocab_size, (len(rows), t))
            batch = StepBatch.build([0] * len(rows), start, q_lens)
            batch.block_table, batch.block_size = tables[rows], 4
            want = model(step_ids, eager, batch, logits="all")  # [B, T, V]
            got = step(step_ids, tables[rows], start, q_lens)
            for b, n in enumerate(q_lens):  # padding positions are never read
                torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-5)
        for layer in range(cfg.num_layers):  # everything but the scratch block, as eager wrote it
            torch.testing.assert_close(graph.kv[layer][:, :, 1:], eager.kv[layer][:, :, 1:])
        eager.kv = [t.clone() for t in graph.kv]  # both start the next backend from the same cache
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


def test_compiled_paged_engine_writes_the_eager_tokens(tiny):
    """The default cache (paged, prefix caching on) compiled: greedy tokens identical to the eager
    paged engine, with n-gram drafts too, and the graph really ran."""
    from moeserve.engine.paged_runner import PagedRunner

    prompts = [[5, 9, 13, 9, 13, 9], [7, 7, 8], [11, 3, 11, 3, 11, 3, 11], [4], [5, 9, 13, 9, 13, 9, 2]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for speculate in (False, True):
        runs = {}
        for compiled in (False, True):
            runner = PagedRunner(load_checkpoint(tiny), 8, 256, num_blocks=200, block_size=4, compile=compiled)
            spec = dict(proposer=NgramProposer(), spec=SpecConfig(num_tokens=3)) if speculate else {}
            eng = LLMEngine(runner, **spec)
            runs[compiled] = [c.token_ids for c in eng.generate(prompts[:1], params) + eng.generate(prompts, params)]
            if compiled:
                assert runner.compiled.num_calls >= params.max_tokens // (4 if speculate else 1)
        assert runs[True] == runs[False]
