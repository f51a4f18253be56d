"""Capacity and overflow: against a slow loop reference, hand examples, and DeepSpeed's topkgating.

Shapes: T tokens, E experts, K = top_k.
"""

import math
from fractions import Fraction

import pytest
import torch

from router_service import GateConfig, apply_capacity, expert_capacity, topk_gate


def reference_capacity(gates, capacity, policy):
    """Obviously-correct loops over routes, written straight from the apply_capacity docstring."""
    ids, probs, weights = gates.expert_ids.tolist(), gates.probs.float(), gates.weights.float().clone()
    num_tokens, top_k, num_experts = len(ids), gates.top_k, gates.num_experts
    routes = [(t, k) for t in range(num_tokens) for k in range(top_k)]
    routes.sort(key=lambda r: (-probs[r[0], ids[r[0]][r[1]]].item(), r[0], r[1]))
    load = [0] * num_experts
    new_ids = [row[:] for row in ids]
    rerouted = [[False] * top_k for _ in range(num_tokens)]
    pending = []
    for t, k in routes:
        if load[ids[t][k]] < capacity:
            load[ids[t][k]] += 1
        else:
            new_ids[t][k] = -1
            pending.append((t, k))
    if policy == "reroute":
        alternatives = {
            t: sorted((e for e in range(num_experts) if e not in ids[t]), key=lambda e: (-probs[t, e].item(), e))
            for t, _ in pending
        }
        for r in range(num_experts - top_k):
            asked, waiting = set(), []
            for t, k in pending:
                if t in asked:
                    waiting.append((t, k))
                    continue
                asked.add(t)
                e = alternatives[t][r]
                if load[e] < capacity:
                    load[e] += 1
                    new_ids[t][k], rerouted[t][k] = e, True
                    scale = gates.weights[t].float().sum() / probs[t, ids[t]].sum()
                    weights[t, k] = probs[t, e] * scale
                else:
                    waiting.append((t, k))
            pending = waiting
    new_ids = torch.tensor(new_ids, dtype=torch.int64).view(num_tokens, top_k)
    weights[new_ids < 0] = 0.0
    return new_ids, weights, torch.tensor(rerouted, dtype=torch.bool).view(num_tokens, top_k)


def _gates(num_tokens, num_experts, k, style="mixtral", ties=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g) * 2  # [T, E]
    if ties:
        logits = logits.round()  # equal probabilities across tokens and within a token
    cfg = GateConfig(num_experts, k, style, norm_topk_prob=style != "softmax_topk", routed_scaling_factor=1.0)
    return topk_gate(logits, cfg)


def test_expert_capacity_formula():
    assert expert_capacity(64, 8, 2, 1.0, min_capacity=0) == 16
    assert expert_capacity(64, 8, 2, 1.25, min_capacity=0) == 20
    assert expert_capacity(10, 3, 1, 1.0, min_capacity=0) == 4  # ceil(3.33) = 4
    assert expert_capacity(10, 3, 1, 1.0, min_capacity=5) == 5
    assert expert_capacity(1, 64, 2, 1.0, min_capacity=0) == 1
    # 1.1 * 100 tokens * 2 / 4 experts is exactly 55; in floats it is 55.00000000000001 and would round up
    assert 1.1 * 100 * 2 / 4 > 55 and expert_capacity(100, 4, 2, 1.1, min_capacity=0) == 55
    for field, args in [("capacity_factor", (8, 4, 2, 0.0, 4)), ("min_capacity", (8, 4, 2, 1.0, -1))]:
        with pytest.raises(ValueError, match=field):
            expert_capacity(*args)


def test_seed_style_hand_example_drop_and_reroute():
    # 3 tokens, 3 experts, top-1; all prefer expert 0, capacity 1. Token 1 has the highest probability
    # for expert 0 so it keeps it; tokens 0 and 2 overflow. Token 2 ranks higher (0.6 > 0.5).
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05], [0.6, 0.1, 0.3]])
    gates = topk_gate(probs.log(), GateConfig(num_experts=3, top_k=1))
    dropped = apply_capacity(gates, 1, "drop")
    assert dropped.expert_ids.squeeze(1).tolist() == [-1, 0, -1]
    assert dropped.weights.squeeze(1).tolist() == [0.0, 1.0, 0.0]
    assert (dropped.num_dropped, dropped.num_rerouted) == (2, 0)
    # reroute round 0: token 2 (priority 0.6) asks for its next best, expert 2, and gets it;
    # token 0 (0.5) asks for expert 1 and gets it. Mixtral top-1 weight = p_new / p_chosen.
    rerouted = apply_capacity(gates, 1, "reroute")
    assert rerouted.expert_ids.squeeze(1).tolist() == [1, 0, 2]
    assert rerouted.weights.squeeze(1).tolist() == pytest.approx([0.3 / 0.5, 1.0, 0.3 / 0.6], abs=1e-6)
    assert rerouted.rerouted.squeeze(1).tolist() == [True, False, True] and rerouted.num_dropped == 0
    # with both free experts reachable only as second choices and capacity 1: token 2 takes expert 2
    # first, token 0 still finds expert 1; a fourth token would be dropped
    four = topk_gate(torch.cat([probs, probs[:1]]).log(), GateConfig(num_experts=3, top_k=1))
    out = apply_capacity(four, 1, "reroute")
    assert out.expert_ids.squeeze(1).tolist() == [1, 0, 2, -1]


@pytest.mark.parametrize("policy", ["drop", "reroute"])
@pytest.mark.parametrize(
    "num_tokens,num_experts,k,cap,style,ties",
    [
        (40, 8, 1, 3, "mixtral", False),
        (40, 8, 2, 6, "mixtral", True),
        (64, 6, 3, 20, "softmax_topk", True),
        (50, 16, 4, 10, "sigmoid_bias", False),
        (30, 4, 2, 0, "mixtral", False),
        (9, 5, 5, 4, "mixtral", True),
    ],
)
def test_matches_slow_reference(policy, num_tokens, num_experts, k, cap, style, ties):
    for seed in range(3):
        gates = _gates(num_tokens, num_experts, k, style, ties, seed)
        routed = apply_capacity(gates, cap, policy)
        ref_ids, ref_weights, ref_rerouted = reference_capacity(gates, cap, policy)
        assert torch.equal(routed.expert_ids, ref_ids)
        assert torch.equal(routed.rerouted, ref_rerouted)
        torch.testing.assert_close(routed.weights.float(), ref_weights, rtol=0, atol=1e-6)
        _check_invariants(gates, routed, cap)


def _check_invariants(gates, routed, cap):
    num_routes = gates.expert_ids.numel()
    assert int(routed.kept.sum()) + routed.num_dropped == num_routes
    assert torch.equal(routed.kept, routed.expert_ids >= 0)
    assert int(routed.rerouted.sum()) == routed.num_rerouted
    assert int(torch.bincount(routed.expert_ids[routed.kept], minlength=gates.num_experts).max()) <= cap
    assert bool((routed.weights[~routed.kept] == 0).all())
    first_choice = ~routed.rerouted & routed.kept
    assert torch.equal(routed.weights[first_choice], gates.weights[first_choice])
    for t in range(gates.num_tokens):
        served = [e for e in routed.expert_ids[t].tolist() if e >= 0]
        assert len(served) == len(set(served))  # a token never sends two routes to one expert


def test_none_and_unlimited_keep_everything():
    gates = _gates(32, 8, 2)
    for routed in (apply_capacity(gates, 1, "none"), apply_capacity(gates, None, "drop")):
        assert torch.equal(routed.expert_ids, gates.expert_ids) and bool(routed.kept.all())
        assert routed.num_dropped == routed.num_rerouted == 0
    assert apply_capacity(gates, 64, "drop").num_dropped == 0
    with pytest.raises(ValueError, match="policy"):
        apply_capacity(gates, 4, "position")


def test_reroute_drops_only_when_no_room_left():
    gates = _gates(100, 8, 2, seed=5)
    cap = 20  # 8 * 20 = 160 slots < 200 routes: exactly 40 routes must be dropped
    routed = apply_capacity(gates, cap, "reroute")
    assert routed.num_dropped == 40 and routed.num_rerouted > 0
    assert torch.bincount(routed.expert_ids[routed.kept], minlength=8).tolist() == [cap] * 8


# DeepSpeed oracle. topkgating's drop_policy="probs" keeps, per expert, the `capacity` routes with the
# highest softmax probability: our `drop`. Its capacity is ceil((T / E) * capacity_factor * k) in
# float; ours is the exact rational ceil(capacity_factor * T * k / E) -- equal whenever the float
# product is exact (powers of two here); see test_capacity_agrees_with_deepspeed_where_exact.
# top1gating / top2gating are not oracles for this: they drop by random token selection or by
# position (cumsum order), not by probability. DeepSpeed also renormalises the kept gates of a token
# after drops; we leave kept weights unchanged (the residual carries what was dropped).


@pytest.fixture(scope="module")
def sharded_moe():
    return pytest.importorskip("deepspeed.moe.sharded_moe")  # import only: never init_distributed


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity_factor,min_capacity", [(0.5, 0), (1.0, 4), (1.25, 0), (2.0, 4)])
def test_drop_decisions_match_deepspeed_topkgating(sharded_moe, k, capacity_factor, min_capacity):
    num_tokens, num_experts = 64, 8
    for seed in range(3):
        logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 2
        out = sharded_moe.topkgating(
            logits.clone(), k, capacity_factor, min_capacity, drop_tokens=True, drop_policy="probs", sparse_routes=True
        )
        ds_capacity, ds_ids, ds_gates = int(out[1]), out[3].t().long(), out[5].t()  # [T, K]
        capacity = expert_capacity(num_tokens, num_experts, k, capacity_factor, min_capacity)
        assert capacity == ds_capacity
        routed = apply_capacity(topk_gate(logits, GateConfig(num_experts, k)), capacity, "drop")
        assert torch.equal(routed.expert_ids, ds_ids)
        assert routed.num_dropped == int((ds_ids < 0).sum())
        assert routed.num_dropped > 0 or capacity_factor > 1.0  # the comparison exercises real drops
        whole = routed.kept.all(dim=1)  # tokens that lost nothing: no renormalisation difference
        torch.testing.assert_close(routed.weights[whole], ds_gates[whole].float(), rtol=0, atol=1e-6)


def test_capacity_agrees_with_deepspeed_where_exact(sharded_moe):
    diverged = []
    for num_tokens in range(1, 120, 4):
        for num_experts in (3, 8, 60):
            for k in (1, 2, 8):
                for cf in (0.5, 1.0, 1.1, 1.2, 1.25, 2.0):
                    ours = expert_capacity(num_tokens, num_experts, k, cf, min_capacity=0)
                    assert ours == math.ceil(Fraction(str(cf)) * num_tokens * k / num_experts)
                    probe = torch.zeros(num_tokens, num_experts)
                    theirs = int(sharded_moe._capacity(probe, torch.tensor(cf * k), torch.tensor(0)))
                    if theirs != ours:
                        diverged.append((num_tokens, num_experts, k, cf, ours, theirs))
    # DeepSpeed multiplies in float32 (cf * k becomes a float32 tensor: 9.6 -> 9.6000004), so an exact
    # integer product can come out one higher; it is never lower. 25 tokens, 8 experts, k=8, cf=1.2: 30 vs 31.
    assert all(theirs == ours + 1 for *_, ours, theirs in diverged)
    assert (25, 8, 8, 1.2, 30, 31) in diverged
    assert len(diverged) < 0.05 * 30 * 3 * 3 * 6
