"""Balance loss and load statistics: the seeds' numbers, transformers and DeepSpeed as oracles.

Shapes: T tokens, E experts (= N), K = top_k, L layers.
"""

import json

import pytest
import torch

from router_service import ExpertLoadStats, GateConfig, apply_capacity, switch_balance_loss, topk_gate


def test_seed_balanced_vs_collapsed():
    # seeds (N = 4): balanced f = P = 0.25 -> 1.0 alpha; collapsed f = [1, 0, 0, 0], P = [0.7, 0.1, 0.1, 0.1] -> 2.8
    balanced = switch_balance_loss(torch.full((8, 4), 0.25), torch.arange(8).remainder(4)[:, None], 4)
    assert float(balanced) == pytest.approx(1.0)
    collapsed_probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(8, 4)
    collapsed = switch_balance_loss(collapsed_probs, torch.zeros(8, 1, dtype=torch.int64), 4)
    assert float(collapsed) == pytest.approx(2.8)
    # top-2: f counts routes / (T * k), so an even router is still 1.0
    pairs = torch.stack([torch.arange(8) % 4, (torch.arange(8) + 1) % 4], dim=1)  # [T, 2]
    assert float(switch_balance_loss(torch.full((8, 4), 0.25), pairs, 4)) == pytest.approx(1.0)


def test_gradient_flows_through_probs_only():
    logits = torch.randn(16, 4, requires_grad=True)
    probs = torch.softmax(logits, -1)  # [T, E]
    ids = probs.topk(2, dim=-1).indices  # [T, K]
    probs.retain_grad()
    switch_balance_loss(probs, ids, 4).backward()
    f = torch.bincount(ids.reshape(-1), minlength=4).float() / ids.numel()
    # d/dp[t, i] of N * sum_i f_i * mean_t p[t, i] = N * f_i / T
    torch.testing.assert_close(probs.grad, (4 * f / 16).expand(16, 4))
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_matches_transformers_load_balancing_loss(k):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = torch.randn(64, 8) * 2  # [T, E]
    gates = topk_gate(logits, GateConfig(8, k))
    ours = switch_balance_loss(gates.probs, gates.expert_ids, 8)
    theirs = mixtral.load_balancing_loss_func((logits,), num_experts=8, top_k=k)
    # transformers counts f per top-k slot (sum_i f_i = k), so its value is k times ours
    torch.testing.assert_close(ours * k, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_matches_deepspeed_l_aux(k):
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    logits = torch.randn(64, 8) * 2
    l_aux = sharded_moe.topkgating(logits.clone(), k, 1.0, 4, drop_tokens=True, sparse_routes=True)[0]
    gates = topk_gate(logits, GateConfig(8, k))
    torch.testing.assert_close(switch_balance_loss(gates.probs, gates.expert_ids, 8), l_aux, rtol=1e-6, atol=1e-6)


def _step(seed, num_tokens=32, num_experts=4, k=2):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 2
    logits[:, 0] += 1.5  # expert 0 is hot
    return topk_gate(logits, GateConfig(num_experts, k))


def test_update_and_summary_against_direct_computation():
    stats = ExpertLoadStats(num_layers=2, num_experts=4)
    steps = [_step(s) for s in range(3)]
    routed = [apply_capacity(g, 18, "reroute") for g in steps]
    for g, r in zip(steps, routed):
        stats.update(0, g, r)
    stats.update(1, steps[0])  # no capacity on layer 1
    layer0, layer1 = stats.summary()

    probs = torch.cat([g.probs for g in steps])  # [3T, E]
    ids = torch.cat([g.expert_ids for g in steps])  # [3T, K]
    assert layer0["balance"] == pytest.approx(float(switch_balance_loss(probs, ids, 4)), rel=1e-6)
    assert layer0["P"] == pytest.approx(probs.double().mean(0).tolist(), rel=1e-6)
    assert layer0["f"] == pytest.approx((torch.bincount(ids.reshape(-1), minlength=4) / ids.numel()).tolist())
    assert layer0["balance"] > 1.05  # the hot expert shows
    served = torch.cat([r.expert_ids.reshape(-1) for r in routed])
    load = torch.bincount(served[served >= 0], minlength=4).double()
    assert layer0["imbalance"] == pytest.approx(float(load.max() / load.mean()))
    assert layer0["dropped"] == sum(r.num_dropped for r in routed)
    assert layer0["rerouted"] == sum(r.num_rerouted for r in routed) > 0
    assert layer0["tokens"] == 96 and layer0["routes"] == 192
    assert (layer1["tokens"], layer1["dropped"], layer1["rerouted"]) == (32, 0, 0)
    demand = torch.bincount(steps[0].expert_ids.reshape(-1), minlength=4).double()
    assert layer1["imbalance"] == pytest.approx(float(demand.max() / demand.mean()))


def test_merge_and_round_trip_through_plain_python():
    a, b, both = (ExpertLoadStats(2, 4) for _ in range(3))
    for layer, seed in [(0, 0), (1, 1)]:
        g = _step(seed)
        a.update(layer, g, apply_capacity(g, 10, "drop"))
        both.update(layer, g, apply_capacity(g, 10, "drop"))
    g = _step(2)
    b.update(0, g)
    both.update(0, g)
    restored = ExpertLoadStats.from_dict(json.loads(json.dumps(a.to_dict())))
    restored.merge(b)
    assert isinstance(a.to_dict()["prob_sums"][0][0], float)
    for name in ExpertLoadStats._FIELDS:
        torch.testing.assert_close(getattr(restored, name), getattr(both, name))
    assert restored.summary()[0]["dropped"] > 0


def test_empty_layer_and_errors():
    stats = ExpertLoadStats(1, 4)
    assert stats.summary()[0]["balance"] is None and stats.summary()[0]["imbalance"] is None
    with pytest.raises(ValueError, match="layer"):
        stats.update(1, _step(0))
    with pytest.raises(ValueError, match="gates"):
        stats.update(0, _step(0, num_experts=8))
    with pytest.raises(ValueError, match="other"):
        stats.merge(ExpertLoadStats(2, 4))
    bad = stats.to_dict()
    bad["route_counts"] = [[0, 0]]
    with pytest.raises(ValueError, match="route_counts"):
        ExpertLoadStats.from_dict(bad)
