"""Expert-parallel shard groups (W = 1, 2, 4 local processes) equal the single-process reference."""

from __future__ import annotations

import pytest
import torch

from bench.local_group import LocalShardGroup
from model_shards import load_checkpoint
from moeserve.config import RoutingSection
from moeserve.engine import LLMEngine, ModelRunner
from moeserve.engine.model_runner import Row
from moeserve.sampling_params import SamplingParams
from router_service.placement import Placement
from tests.model_shards.hf_tiny import save_tiny

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "deepseek_v3"])
def ckpt(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, folder)
    return folder


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def prefill_logits(runner, ps: list[list[int]]) -> torch.Tensor:
    for i in range(len(ps)):
        runner.add(f"s{i}")
    out = runner.forward([Row(f"s{i}", p, 0) for i, p in enumerate(ps)], logits="all")
    for i in range(len(ps)):
        runner.remove(f"s{i}")
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_logits_and_greedy_equal_reference(ckpt, world):
    ps = prompts(5, seed=world)
    ref_runner = ModelRunner(load_checkpoint(ckpt), max_num_seqs=8, max_model_len=64)
    ref_logits = prefill_logits(ref_runner, ps)
    ref_tokens = [c.token_ids for c in LLMEngine(ref_runner).generate(ps, GREEDY)]
    with LocalShardGroup(ckpt, world, max_num_seqs=8, max_model_len=64) as runner:
        logits = prefill_logits(runner, ps)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        tokens = [c.token_ids for c in LLMEngine(runner).generate(ps, GREEDY)]
    assert tokens == ref_tokens


def run_with_replacements(engine: LLMEngine, ps: list[list[int]], placements: dict[int, Placement]) -> list[list[int]]:
    """Greedy tokens of `ps`, applying placements[n] to the group after its n-th step."""
    for i, p in enumerate(ps):
        engine.add_request(p, GREEDY, f"r{i}")
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
        if steps in placements:
            engine.runner.replace(placements[steps])
    return [out[f"r{i}"] for i in range(len(ps))]


def test_live_replacement_between_steps_is_exact(ckpt):
    """Experts move between ranks while sequences are mid-generation (and a hot pair gets a
    replica): tokens equal the single-process reference, and each rank holds the new experts."""
    ps = prompts(5, seed=21)
    ref = [c.token_ids for c in LLMEngine(ModelRunner(load_checkpoint(ckpt), 8, 64)).generate(ps, GREEDY)]
    num_experts = load_checkpoint(ckpt).config.num_experts
    odd_even = Placement((tuple(range(1, num_experts, 2)), tuple(range(0, num_experts, 2))))
    replicated = Placement((tuple(range(0, num_experts // 2 + 1)), tuple(range(num_experts // 2 - 1, num_experts))))
    with LocalShardGroup(ckpt, 2, max_num_seqs=8, max_model_len=64) as runner:
        tokens = run_with_replacements(LLMEngine(runner), ps, {2: odd_even, 5: replicated})
        held = {b.experts.expert_ids for b in runner.model.moe_blocks}
    assert tokens == ref
    assert held == {replicated.rank_experts[0]}


@pytest.mark.parametrize("overflow", ["drop", "reroute"])
def test_capacity_policies_equal_reference_with_same_decisions(ckpt, overflow):
    """With data-parallel attention each rank applies capacity to its own tokens; the reference
    makes the same decisions when it runs each rank's sequences as its own batch."""
    routing = RoutingSection(overflow=overflow, capacity_factor=0.5 if overflow == "drop" else 1.0, min_capacity=1)
    ps = prompts(4, seed=9)
    ref_model = load_checkpoint(ckpt)
    ref_model.set_routing(routing)
    ref_stats = ref_model.enable_stats()
    # sequences go to the least-loaded rank in order: s0 -> 0, s1 -> 1, s2 -> 0, s3 -> 1
    per_rank = {0: [0, 2], 1: [1, 3]}
    ref = {}
    for idxs in per_rank.values():
        out = prefill_logits(ModelRunner(ref_model, 4, 64), [ps[i] for i in idxs])
        ref.update({i: out[j] for j, i in enumerate(idxs)})
    summary = ref_stats.summary()
    with LocalShardGroup(ckpt, 2, max_num_seqs=4, max_model_len=64, routing=routing) as runner:
        logits = prefill_logits(runner, ps)
    for i in range(len(ps)):
        n = len(ps[i])
        torch.testing.assert_close(logits[i, :n], ref[i][:n], atol=1e-5, rtol=0)
    # counters add up: every route is either served by an expert or dropped
    for layer in summary:
        if layer["tokens"]:
            assert layer["routes"] == layer["tokens"] * ref_model.config.top_k
    load = ref_stats.expert_load.sum(dim=1)  # [L]
    assert torch.equal(load + ref_stats.dropped, ref_stats.routes)
    assert int(ref_stats.dropped.sum() if overflow == "drop" else ref_stats.rerouted.sum()) > 0


def test_all_to_all_dispatch_equals_local_dispatch():
    """The all-to-all path (plan, split-size exchange, token and result exchange) gives
    LocalDispatch's outputs; a one-rank gloo group runs the real collectives in this process."""
    import torch.distributed as dist

    from model_shards.all_to_all import AllToAllDispatch, init_shard_group
    from model_shards.local_group import free_port
    from model_shards.moe import LocalDispatch, LocalExperts
    from router_service.placement import contiguous_placement

    g = torch.Generator().manual_seed(0)
    experts = LocalExperts(range(4), hidden=16, intermediate=8)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(40, 16, generator=g)
    ids = torch.randint(0, 4, (40, 2), generator=g)
    ids[3, 1] = -1  # a dropped route
    weights = torch.rand(40, 2, generator=g)
    init_shard_group(0, 1, f"127.0.0.1:{free_port()}")
    try:
        out = AllToAllDispatch(contiguous_placement(4, 1), rank=0)(x, ids, weights, experts)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(out, LocalDispatch()(x, ids, weights, experts), atol=1e-5, rtol=0)


def test_ranks_cache_prefixes_and_outputs_stay_exact(ckpt):
    """Each rank's paged cache shares prompt prefixes: a request whose prefix a rank holds goes
    there and skips those tokens; greedy replies equal the reference either way."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, 96, (20,), generator=g).tolist()
    ps = [prefix + torch.randint(2, 96, (3,), generator=g).tolist() for _ in range(4)]
    ref = [c.token_ids for c in LLMEngine(ModelRunner(load_checkpoint(ckpt), 8, 64)).generate(ps, GREEDY)]
    with LocalShardGroup(ckpt, 2, max_num_seqs=4, max_model_len=64, block_size=4) as runner:
        engine = LLMEngine(runner)
        first = [c.token_ids for c in engine.generate(ps[:1], GREEDY)]
        assert runner.add("probe", ps[1]) == 20 and runner._rank_of["probe"] == 0  # rank 0 holds the prefix
        runner.remove("probe")
        rest = [c.token_ids for c in engine.generate(ps[1:], GREEDY)]
        stats = runner.stats()
    assert first + rest == ref
    assert stats["prefix_cache_hit_blocks"] >= 3 * 5 and stats["kv_blocks_held"] == 0  # finished: nothing held


def test_each_rank_reports_its_own_tokens_routing(ckpt):
    """Traced requests on a 2-rank group: each token's experts (recorded on the rank that holds
    the sequence, gathered to rank 0) equal the single-process engine's trace."""
    from moeserve.engine.model_runner import ModelRunner

    traced = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, trace_experts=True)
    ps = prompts(3, seed=13)

    def traces(engine):
        ids = [engine.add_request(p, traced) for p in ps]
        out = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.trace
        return [[e.experts for e in out[rid]] for rid in ids]

    ref = traces(LLMEngine(ModelRunner(load_checkpoint(ckpt), 8, 64, num_blocks=64, block_size=4)))
    with LocalShardGroup(ckpt, 2, max_num_seqs=4, max_model_len=64, block_size=4) as runner:
        got = traces(LLMEngine(runner))  # the three sequences go to ranks 0, 1, 0
    for want_seq, got_seq in zip(ref, got):
        assert len(got_seq) == len(want_seq) == traced.max_tokens
        for want, have in zip(want_seq, got_seq):
            assert [(layer, ids) for layer, ids, _ in have] == [(layer, ids) for layer, ids, _ in want]
            for (_, _, w1), (_, _, w2) in zip(have, want):
                assert max(abs(a - b) for a, b in zip(w1, w2)) < 1e-3


def test_compiled_ranks_equal_the_eager_reference(tmp_path):
    """Each rank's decode and verify passes compiled between the all-to-alls: logits equal the
    single-process eager model's for ragged verify rows (padding kept out of the dispatch) and for
    decode, and transformers' (fp32) too; greedy tokens are the same, and the compiled passes are
    what ran. One family (its compiling takes most of a minute): qwen2_moe, whose shared expert is
    in the graph too."""
    ckpt = tmp_path / "qwen2_moe"
    hf = save_tiny("qwen2_moe", ckpt)
    ps = prompts(4, seed=7)
    extra = [[5, 6, 7, 8][: i % 4 + 1] for i in range(len(ps))]  # 1..4 positions a row, as verify passes

    def passes(runner) -> list[torch.Tensor]:
        for i, p in enumerate(ps):
            runner.add(f"s{i}", p)
        out = [runner.forward([Row(f"s{i}", p, 0) for i, p in enumerate(ps)], logits="all")]  # prefill: eager
        out.append(runner.forward([Row(f"s{i}", e, len(p)) for i, (p, e) in enumerate(zip(ps, extra))], logits="all"))
        out.append(runner.forward([Row(f"s{i}", [9], len(p) + len(e)) for i, (p, e) in enumerate(zip(ps, extra))]))
        for i in range(len(ps)):
            runner.remove(f"s{i}")
        return out

    ref_runner = ModelRunner(load_checkpoint(ckpt), max_num_seqs=8, max_model_len=64)
    want = passes(ref_runner)
    ref_tokens = [c.token_ids for c in LLMEngine(ref_runner).generate(ps, GREEDY)]
    with LocalShardGroup(ckpt, 2, max_num_seqs=8, max_model_len=64, compile=True) as runner:
        got = passes(runner)
        assert runner.compiled.num_calls == 2  # the verify-shaped and the decode pass; the prefill ran eagerly
        tokens = [c.token_ids for c in LLMEngine(runner).generate(ps, GREEDY)]
    for g, w, lengths in zip(got, want, ([len(p) for p in ps], [len(e) for e in extra])):  # prefill, verify
        for b, n in enumerate(lengths):  # each row's real positions (padding is never read)
            torch.testing.assert_close(g[b, :n], w[b, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-5)  # decode
    assert tokens == ref_tokens
    with torch.no_grad():
        for b, (p, e) in enumerate(zip(ps, extra)):
            full = hf(torch.tensor([p + e + [9]])).logits[0].float()  # [T, V]
            for g, at in ((got[0][b, : len(p)], slice(0, len(p))), (got[1][b, : len(e)], slice(len(p), len(p) + len(e))),
                          (got[2][b], len(p) + len(e))):
                torch.testing.assert_close(g, full[at], rtol=0, atol=1e-4)


def test_reloading_experts_reads_only_the_ones_not_held(ckpt):
    """What a survivor of a dead rank does: keep its experts in their slots, read the lost ones."""
    from model_shards.loader import reload_experts
    from model_shards.moe import LocalExperts

    full = load_checkpoint(ckpt)
    model = load_checkpoint(ckpt, experts=(0, 1))
    assert reload_experts(model, (0, 1)) == 0  # held already: nothing read
    read = reload_experts(model, (0, 1, 3))
    layers = [m for m in model.modules() if isinstance(m, LocalExperts)]
    one_expert = sum(p[0].numel() * p.element_size() for p in (layers[0].gate_up_proj, layers[0].down_proj))
    assert read == len(layers) * one_expert  # expert 3, and only it, in every MoE layer
    for got, want in zip(layers, [m for m in full.modules() if isinstance(m, LocalExperts)]):
        assert got.expert_ids == (0, 1, 3)
        assert torch.equal(got.gate_up_proj, want.gate_up_proj[[0, 1, 3]])
        assert torch.equal(got.down_proj, want.down_proj[[0, 1, 3]])
