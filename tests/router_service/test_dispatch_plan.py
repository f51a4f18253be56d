"""Dispatch plan: permutation round trip, split sizes, and a simulated all-to-all.

Shapes: T tokens, K = top_k, R kept routes, W ranks, D hidden.
"""

import ast
from pathlib import Path

import pytest
import torch

from router_service import (
    GateConfig,
    Placement,
    apply_capacity,
    build_dispatch_plan,
    contiguous_placement,
    topk_gate,
)


def _routed_ids(num_tokens=50, num_experts=8, k=2, capacity=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    gates = topk_gate(torch.randn(num_tokens, num_experts, generator=g), GateConfig(num_experts, k))
    return apply_capacity(gates, capacity, "drop").expert_ids  # [T, K] with -1 for dropped


def test_hand_example():
    ids = torch.tensor([[3, 0], [1, -1], [2, 3]])  # [T=3, K=2]
    plan = build_dispatch_plan(ids, contiguous_placement(4, 2))  # rank 0: (0, 1); rank 1: (2, 3)
    # kept routes in route order: 0:(t0,e3) 1:(t0,e0) 2:(t1,e1) 3:(t2,e2) 4:(t2,e3)
    assert plan.order.tolist() == [1, 2, 3, 0, 4]
    assert plan.route_index.tolist() == [1, 2, 4, 0, 5]
    assert plan.token_index.tolist() == [0, 1, 2, 0, 2]
    assert plan.dest_rank.tolist() == [0, 0, 1, 1, 1]
    assert plan.local_expert.tolist() == [0, 1, 0, 1, 1]
    assert plan.send_counts == [2, 3]
    assert plan.slot_counts.tolist() == [[1, 1], [1, 2]]  # rank 1 gets one route for expert 2, two for 3


@pytest.mark.parametrize("world", [1, 2, 4])
def test_round_trip_and_counts(world):
    ids = _routed_ids()
    plan = build_dispatch_plan(ids, contiguous_placement(8, world), world_size=world)
    kept = int((ids >= 0).sum())
    assert plan.order.numel() == kept and sum(plan.send_counts) == kept and len(plan.send_counts) == world
    assert torch.equal(plan.order[plan.inverse_order], torch.arange(kept))
    x = torch.randn(kept, 4)  # [R, D] one row per kept route, in route order
    assert torch.equal(x[plan.order][plan.inverse_order], x)
    # sorted by destination rank, then local expert; counts match the rank column
    key = plan.dest_rank * 8 + plan.local_expert
    assert bool((key[1:] >= key[:-1]).all())
    assert torch.bincount(plan.dest_rank, minlength=world).tolist() == plan.send_counts
    assert torch.equal(plan.token_index, plan.route_index // ids.shape[1])


def test_simulated_all_to_all_reproduces_reference_moe():
    """Dispatch with the plan to W simulated ranks, run their local experts, combine: equals the dense loop."""
    num_tokens, num_experts, k, dim, world = 40, 6, 2, 5, 3
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(num_tokens, dim, generator=g)  # [T, D]
    experts = torch.randn(num_experts, dim, dim, generator=g)  # [E, D, D] a linear "expert" each
    gates = topk_gate(torch.randn(num_tokens, num_experts, generator=g), GateConfig(num_experts, k))
    routed = apply_capacity(gates, 12, "drop")
    placement = Placement(((0, 5), (1, 2, 0), (3, 4)))  # expert 0 replicated on ranks 0 and 1

    plan = build_dispatch_plan(routed.expert_ids, placement, world_size=world)
    sent = hidden[plan.token_index]  # [R, D]
    outputs = []
    for rank, chunk, slots in zip(
        range(world), sent.split(plan.send_counts), plan.local_expert.split(plan.send_counts)
    ):
        local = torch.tensor(placement.rank_experts[rank])[slots]  # logical expert of each received row
        outputs.append(torch.einsum("rd,rde->re", chunk, experts[local]))
    back = torch.cat(outputs)[plan.inverse_order]  # [R, D] in route order
    kept_routes = plan.route_index[plan.inverse_order]
    weights = routed.weights.reshape(-1)[kept_routes]  # [R]
    combined = torch.zeros(num_tokens, dim).index_add_(0, kept_routes // k, back * weights[:, None])

    reference = torch.zeros(num_tokens, dim)
    for t in range(num_tokens):
        for slot in range(k):
            e = int(routed.expert_ids[t, slot])
            if e >= 0:
                reference[t] += routed.weights[t, slot] * (hidden[t] @ experts[e])
    torch.testing.assert_close(combined, reference)
    assert routed.num_dropped > 0  # the plan really skipped dropped routes


def test_empty_and_invalid():
    plan = build_dispatch_plan(torch.full((3, 2), -1), contiguous_placement(4, 2))
    assert plan.send_counts == [0, 0] and plan.order.numel() == 0
    with pytest.raises(ValueError, match="world_size"):
        build_dispatch_plan(torch.zeros(2, 1, dtype=torch.int64), contiguous_placement(4, 2), world_size=4)
    with pytest.raises(ValueError, match="expert_ids"):
        build_dispatch_plan(torch.tensor([[4]]), contiguous_placement(4, 2))


def test_router_service_never_imports_torch_distributed():
    """The plan only describes the all-to-all: no torch.distributed here (tests/test_layering.py covers Ray)."""
    package = Path(__file__).resolve().parents[2] / "router_service"
    files = sorted(package.glob("*.py"))
    assert package / "gating.py" in files and package / "dispatch_plan.py" in files  # the glob found the package
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            bad = [n for n in names if n.startswith("torch.distributed")]
            assert not bad, f"{path.name} imports {bad}"
