"""The paged KV cache: block allocation (a property test against a simple reference), outputs
identical to the model's forward without a cache (prefix caching on and off, under preemption,
with speculation, after copy-on-write), prefix-cache reuse, memory that is the budget from the
start and never grows, and no leaked block after many requests with aborts."""

from __future__ import annotations

import random

import pytest
import torch

from model_shards import PagedKVCache, load_checkpoint
from model_shards.config import ModelConfig
from model_shards.kv_cache import BlockAllocator, OutOfBlocks
from moeserve.config import AppConfig
from moeserve.engine import LLMEngine, ModelRunner, SchedulerConfig, SpecConfig
from moeserve.engine.factory import kv_blocks, scheduler_config
from moeserve.engine.model_runner import Row
from moeserve.sampling_params import SamplingParams
from moeserve.spec.ngram import NgramProposer
from tests.model_shards.hf_tiny import save_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MAX_LEN = 128


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    save_tiny("mixtral", folder)
    return folder


def paged(ckpt, num_blocks=200, block_size=4, prefix_caching=True, max_num_seqs=8) -> ModelRunner:
    return ModelRunner(load_checkpoint(ckpt), max_num_seqs, MAX_LEN, num_blocks, block_size, prefix_caching)


def uncached(ckpt, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Greedy replies from the model's full forward over every token so far (no KV cache)."""
    model = load_checkpoint(ckpt)
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(params.max_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        out.append(ids[len(p):])
    return out


def uncached_logits(ckpt, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] of the model's full forward over `tokens` (no KV cache)."""
    return load_checkpoint(ckpt)(torch.tensor([tokens]))[0]


def engine(runner, block_size=1, budget=0, proposer=None, k=0) -> LLMEngine:
    sched = SchedulerConfig(runner.max_num_seqs, 2048, MAX_LEN, kv_budget_tokens=budget, block_size=block_size)
    return LLMEngine(runner, scheduler=sched, proposer=proposer, spec=SpecConfig(num_tokens=k))


def shared_prompts(n: int, seed: int = 0, prefix_len: int = 21) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, 96, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(2, 96, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_allocator_never_hands_out_a_held_block():
    """Random allocate / free / commit / lookup against a reference of who holds what."""
    rng = random.Random(0)
    alloc = BlockAllocator(17)
    held: list[int] = []  # one entry per reference
    content: dict[int, int] = {}  # committed block -> hash
    for _ in range(5000):
        op = rng.random()
        if op < 0.4:
            try:
                b = alloc.allocate()
            except OutOfBlocks:
                assert alloc.num_free == 0
                continue
            assert b != 0 and b not in held, f"block {b} handed out while held"
            content.pop(b, None)  # an evicted cached block loses its identity
            held.append(b)
        elif op < 0.7 and held:
            b = held.pop(rng.randrange(len(held)))
            alloc.free(b)
        elif op < 0.85 and held:
            b = rng.choice(held)
            h = rng.randrange(6)
            if b not in content and h not in content.values():
                alloc.commit(b, h)
                content[b] = h
        else:
            want = [rng.randrange(6) for _ in range(rng.randrange(1, 3))]
            for b in alloc.lookup(want):
                assert content.get(b) in want
                held.append(b)
        assert alloc.num_free == 16 - len(set(held))
        assert all(alloc.refcount(b) == held.count(b) for b in set(held))


def test_paged_logits_equal_the_forward_without_a_cache(ckpt):
    """One prefill and a ragged verify-like step, read through block tables of size 3."""
    ps = shared_prompts(3, seed=1)
    runner = paged(ckpt, block_size=3, prefix_caching=False)
    for i in range(3):
        runner.add(f"s{i}")
    out = runner.forward([Row(f"s{i}", p, 0) for i, p in enumerate(ps)], "all")  # [B, Tq, V]
    for i, p in enumerate(ps):
        torch.testing.assert_close(out[i, : len(p)], uncached_logits(ckpt, p), atol=1e-5, rtol=0)
    more = [[5, 6, 7][: i + 1] for i in range(3)]
    out = runner.forward([Row(f"s{i}", m, len(p)) for i, (p, m) in enumerate(zip(ps, more))], "all")
    for i, (p, m) in enumerate(zip(ps, more)):
        torch.testing.assert_close(out[i, : len(m)], uncached_logits(ckpt, p + m)[len(p):], atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_generation_equals_the_uncached_forward_with_and_without_prefix_caching(ckpt, prefix_caching):
    ps = shared_prompts(6, seed=2)
    ref = uncached(ckpt, ps, GREEDY)
    runner = paged(ckpt, prefix_caching=prefix_caching)
    eng = engine(runner, block_size=4)
    assert [c.token_ids for c in eng.generate(ps[:1], GREEDY)] == ref[:1]  # fills the prefix cache
    assert [c.token_ids for c in eng.generate(ps, GREEDY)] == ref
    stats = runner.stats()
    assert (stats["prefix_cache_hit_blocks"] >= 5 * (21 // 4)) == prefix_caching
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every finished sequence gave its blocks back


def test_a_prefix_hit_skips_the_cached_tokens(ckpt):
    runner = paged(ckpt, block_size=4)
    p = shared_prompts(1, seed=3)[0]
    assert runner.add("a", p) == 0
    runner.forward([Row("a", p, 0)])
    assert runner.add("b", p) == (len(p) - 1) // 4 * 4  # whole blocks, leaving the last token
    assert runner.add("c", p[:3]) == 0  # shorter than a block
    assert runner.add("d", [99] + p[1:]) == 0  # different first block: the chain breaks


def test_preemption_and_speculation_keep_outputs_identical(ckpt):
    """A budget of 34 blocks of 4 tokens cannot hold six sequences at once: the newest are
    preempted and recomputed (from the prefix cache). N-gram drafts are verified and rolled back."""
    ps = shared_prompts(6, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = uncached(ckpt, ps, params)
    runner = paged(ckpt, num_blocks=35, block_size=4)
    eng = engine(runner, block_size=4, budget=136, proposer=NgramProposer(), k=3)
    assert [c.token_ids for c in eng.generate(ps, params)] == ref
    assert eng.scheduler.num_preemptions > 0 and eng.spec_metrics.num_draft_tokens > 0
    assert runner.stats()["kv_blocks_free"] == 34


def test_memory_is_the_budget_from_the_start_and_after_a_thousand_requests_with_aborts(ckpt):
    """engine.kv_cache_memory: the cache is as many blocks as fit, every one allocated at start; a
    thousand short requests (with aborts and prefix hits) neither grow nor move it, and
    every block comes back."""
    cfg = AppConfig.from_options(str(ckpt), "none", max_num_seqs=8, max_model_len=MAX_LEN, block_size=4,
                                 kv_cache_memory=120 * 1024 + 1000)
    block = PagedKVCache.block_bytes(ModelConfig.from_file(ckpt), 4, torch.float32)
    assert block == 2 * 2 * 4 * 2 * 8 * 4  # tiny mixtral: K and V, 2 layers, 4 tokens, 2 kv heads of 8, fp32
    assert kv_blocks(cfg) == 120 and block == 1024  # whole blocks within the budget, the scratch one included
    runner = ModelRunner(load_checkpoint(ckpt), 8, MAX_LEN, kv_blocks(cfg), 4)
    eng = LLMEngine(runner, scheduler=scheduler_config(cfg))
    assert runner.stats()["kv_bytes_allocated"] == 120 * block
    addresses = [t.data_ptr() for t in runner.cache.kv]
    rng = random.Random(5)
    prompts = shared_prompts(40, seed=6)
    live: list[str] = []
    for i in range(1000):
        p = SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.0, ignore_eos=True)
        live.append(eng.add_request(rng.choice(prompts), p, f"r{i}"))
        if rng.random() < 0.3 and eng.has_unfinished():
            eng.abort(rng.choice(live))
        if i % 8 == 7:
            for _ in range(rng.randint(1, 3)):
                eng.step()
    while eng.has_unfinished():
        eng.step()
    stats = runner.stats()
    assert stats["kv_bytes_allocated"] == 120 * block and [t.data_ptr() for t in runner.cache.kv] == addresses
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not len(runner.manager)
    assert stats["prefix_cache_hit_blocks"] > 0


def test_the_budget_in_tokens_is_blocks_plus_scratch_and_a_full_cache_refuses_blocks(ckpt):
    """engine.kv_budget_tokens: that many tokens in blocks plus the scratch block, all allocated at
    start; a sequence wanting more blocks than are free is refused (OutOfBlocks), holding what it held."""
    cfg = AppConfig.from_options(str(ckpt), "none", max_num_seqs=2, max_model_len=20, block_size=4,
                                 kv_budget_tokens=30)
    assert kv_blocks(cfg) == 9 and scheduler_config(cfg).kv_budget == 32
    runner = ModelRunner(load_checkpoint(ckpt), 2, 20, kv_blocks(cfg), 4)
    assert runner.cache.nbytes == 9 * 1024
    runner.add("a")
    runner.prepare("a", 0, list(range(2, 22)))  # 5 blocks
    runner.add("b")
    runner.prepare("b", 0, list(range(2, 10)))  # 2 blocks: 1 left
    with pytest.raises(OutOfBlocks):
        runner.prepare("b", 8, [5, 6, 7, 8, 9])  # 2 more blocks
    assert len(runner.manager.tables["b"]) == 2 and runner.blocks.num_free == 1 and runner.cache.nbytes == 9 * 1024


def test_n_copies_of_a_prompt_share_its_prefill(ckpt):
    """Four requests with one prompt (what n=4 sends): one is prefilled, the other three reuse its
    prompt blocks a step later; their replies are the uncached forward's."""
    p = shared_prompts(1, seed=7)[0]
    ref = uncached(ckpt, [p], GREEDY) * 4
    runner = paged(ckpt, block_size=4)
    sched = SchedulerConfig(8, 2048, MAX_LEN, block_size=4, share_prefill=True)
    eng = LLMEngine(runner, scheduler=sched)
    assert [c.token_ids for c in eng.generate([p] * 4, GREEDY)] == ref
    assert runner.stats()["prefix_cache_hit_blocks"] == 3 * ((len(p) - 1) // 4)


def test_a_sequence_rewinding_into_shared_blocks_writes_copies_of_its_own(ckpt):
    """A rewinds into blocks B shares with it (and the prefix cache holds): A's new tokens go to
    copies, so B, a later prefix hit and A itself all read what a fresh pass computes."""
    runner = paged(ckpt)
    prompt = shared_prompts(1, seed=3, prefix_len=14)[0][:14]
    runner.add("a", prompt)
    runner.forward([Row("a", prompt, 0)])
    assert runner.add("b", prompt + [7]) == 12  # three shared blocks
    rewound = prompt[:6] + [9, 9, 9]  # position 6 lies in the second shared block
    got = runner.forward([Row("a", rewound[6:], 6)])
    torch.testing.assert_close(got[0], uncached_logits(ckpt, rewound)[-1], atol=1e-5, rtol=1e-5)
    for seq, tokens in (("b", prompt + [7]), ("c", prompt + [5])):
        if seq == "c":
            assert runner.add("c", tokens) == 12  # the prefix cache still has the original blocks
        got = runner.forward([Row(seq, tokens[12:], 12)])
        torch.testing.assert_close(got[0], uncached_logits(ckpt, tokens)[-1], atol=1e-5, rtol=1e-5)
