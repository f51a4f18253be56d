"""The all-to-all's two layouts (model_shards/all_to_all.py): the padded one equals the exact one
and the single-process reference at W = 1, 2, 4 (gloo groups on the CPU), expert slots are exact
past what the activations' dtype holds, and the padded layer reads nothing on the host."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.local_group import LocalShardGroup
from model_shards import load_checkpoint
from model_shards.all_to_all import AllToAllDispatch, init_shard_group
from model_shards.local_group import free_port, load_shard
from model_shards.moe import LocalDispatch, LocalExperts
from moeserve.engine import LLMEngine, ModelRunner
from moeserve.sampling_params import SamplingParams
from router_service.placement import Placement, contiguous_placement
from tests.model_shards.hf_tiny import save_tiny

TOKENS = (6, 0, 11, 3)  # rank r routes TOKENS[r % 4] tokens: ranks differ, one has none


def all_experts(num: int, dtype: torch.dtype) -> LocalExperts:
    g = torch.Generator().manual_seed(0)
    e = LocalExperts(range(num), hidden=16, intermediate=8)
    with torch.no_grad():
        for p in e.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return e.to(dtype)


def rank_experts(full: LocalExperts, ids: tuple[int, ...]) -> LocalExperts:
    mine = LocalExperts(ids, full.gate_up_proj.shape[-1], full.down_proj.shape[-1]).to(full.gate_up_proj.dtype)
    with torch.no_grad():
        mine.gate_up_proj.copy_(full.gate_up_proj[list(ids)])
        mine.down_proj.copy_(full.down_proj[list(ids)])
    return mine


def _check_rank(rank: int, world: int, master: str, placement: Placement, dtype: torch.dtype, low: int) -> None:
    """One rank: its tokens through both layouts and through LocalDispatch with every expert."""
    torch.set_num_threads(1)
    init_shard_group(rank, world, master)
    try:
        full = all_experts(placement.num_experts, dtype)
        g = torch.Generator().manual_seed(100 + rank)
        n = TOKENS[rank % 4]
        x = torch.randn(n, 16, generator=g).to(dtype)
        ids = torch.randint(low, placement.num_experts, (n, 2), generator=g)
        ids[::4, 1] = -1  # dropped routes
        weights = torch.rand(n, 2, generator=g)
        mine = rank_experts(full, placement.rank_experts[rank])
        exact = AllToAllDispatch(placement, rank, padded=False)(x, ids, weights, mine)
        padded = AllToAllDispatch(placement, rank, padded=True)
        padded.max_tokens = max(TOKENS[r % 4] for r in range(world))
        got = padded(x, ids, weights, mine)
        want = LocalDispatch()(x, ids, weights, full)
        tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(exact, want, **tol)
        torch.testing.assert_close(got, exact, **tol)
    finally:
        dist.destroy_process_group()


def run_ranks(placement: Placement, dtype: torch.dtype = torch.float32, low: int = 0) -> None:
    world = placement.world_size
    mp.spawn(_check_rank, args=(world, f"127.0.0.1:{free_port()}", placement, dtype, low), nprocs=world)


@pytest.mark.parametrize("placement", [
    contiguous_placement(8, 1),
    Placement(((0, 1, 2, 3, 4), (3, 4, 5, 6, 7))),  # experts 3 and 4 on both ranks
    contiguous_placement(8, 4),
], ids=["W=1", "W=2 replicated", "W=4"])
def test_padded_equals_exact_and_the_reference(placement):
    run_ranks(placement)


@pytest.mark.parametrize("world", [1, 2])
def test_expert_slots_are_exact_past_256_in_bf16(world):
    """The last rank holds 300 experts; routes go to its slots 250..299, which bf16 cannot hold
    as numbers (it rounds 257 to 256): both layouts still reach the right expert."""
    first = () if world == 1 else ((0, 1),)
    start = 2 if world == 2 else 0
    placement = Placement(first + (tuple(range(start, start + 300)),))
    run_ranks(placement, torch.bfloat16, low=start + 250)


SYNCING = {"_local_scalar_dense", "nonzero", "bincount", "repeat_interleave", "masked_select", "unique_dim",
           "_unique2", "unique_consecutive", "equal", "is_nonzero"}


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op that reads a tensor's values on the host (or sizes its output by them):
    on a GPU each is a device-to-host sync. On the CPU that is all one can check structurally."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for a in args if isinstance(a, (list, tuple)) for i in a)
        if name in SYNCING or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def host_reads(monkeypatch, fn) -> list[str]:
    mode = HostReads()
    for method in ("tolist", "cpu", "numpy", "item"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda self, *a, _m=method, _r=real, **k: mode.seen.append(_m) or _r(self, *a, **k))
    with mode:
        fn()
    monkeypatch.undo()
    return mode.seen


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_moe")
    save_tiny("qwen2_moe", folder)
    return folder


def test_a_padded_moe_layer_reads_nothing_on_the_host(ckpt, monkeypatch):
    """Router, statistics, dispatch, experts, combine and the shared expert of one MoE layer at
    W = 1: no value read on the host with the padded layout; the exact one reads (the control)."""
    placement = contiguous_placement(load_checkpoint(ckpt).config.num_experts, 1)
    init_shard_group(0, 1, f"127.0.0.1:{free_port()}")
    try:
        model = load_shard(ckpt, placement, 0)
        model.enable_stats()
        block = model.moe_blocks[0]
        x = torch.randn(12, model.config.hidden_size)
        outs, reads = {}, {}
        for padded in (True, False):
            block.dispatch = AllToAllDispatch(placement, 0, padded=padded)
            block.dispatch.max_tokens = 16
            with torch.no_grad():
                reads[padded] = host_reads(monkeypatch, lambda p=padded: outs.setdefault(p, block(x)))
    finally:
        dist.destroy_process_group()
    assert reads[True] == []
    assert "tolist" in reads[False] and "cpu" in reads[False]
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_groups_with_the_padded_layout_equal_the_exact_one(ckpt, world):
    """Whole shard groups: logits, greedy tokens and rank 0's expert-load statistics are the same
    with either layout, and the padded one is what ran (decode passes within PADDED_MAX_TOKENS)."""
    g = torch.Generator().manual_seed(world)
    ps = [torch.randint(2, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (5,), generator=g)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLMEngine(ModelRunner(load_checkpoint(ckpt), 8, 64)).generate(ps, greedy)]
    got = {}
    for padded in (False, True):
        with LocalShardGroup(ckpt, world, max_num_seqs=8, max_model_len=64, padded=padded) as runner:
            stats = runner.model.enable_stats()
            dispatch = runner.model.moe_blocks[0].dispatch
            calls = []
            real = dispatch._route_padded
            dispatch._route_padded = lambda *a, _c=calls, _r=real: _c.append(1) or _r(*a)
            tokens = [c.token_ids for c in LLMEngine(runner).generate(ps, greedy)]
            got[padded] = (tokens, stats.to_dict(), len(calls))
    assert got[False][0] == got[True][0] == want
    exact, padded = got[False][1], got[True][1]
    for name in ("route_counts", "expert_load", "tokens", "routes"):
        assert exact[name] == padded[name], name
    assert padded["tokens"][0] > 0
    torch.testing.assert_close(torch.tensor(padded["prob_sums"]), torch.tensor(exact["prob_sums"]))
    assert got[False][2] == 0 and got[True][2] > 0
