"""Placement: contiguous blocks, replicas, and EPLB-style balancing on a skewed load.

Shapes: E experts, W ranks, S slots per rank, L layers.
"""

import pytest
import torch

from router_service import Placement, balanced_placement, contiguous_placement
from router_service.placement import with_new_rank, with_second_homes, without_ranks


def test_contiguous_even_and_uneven():
    assert contiguous_placement(8, 4).rank_experts == ((0, 1), (2, 3), (4, 5), (6, 7))
    # numpy.array_split rule: the first E % W ranks take one more
    assert contiguous_placement(10, 4).rank_experts == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9))
    assert contiguous_placement(5, 1).rank_experts == ((0, 1, 2, 3, 4),)
    with pytest.raises(ValueError, match="num_experts"):
        contiguous_placement(3, 4)


def test_lookups_and_replicas():
    placement = Placement(((0, 1, 2), (2, 3), (3, 0)))
    assert (placement.world_size, placement.num_experts) == (3, 4)
    assert placement.expert_to_ranks() == ((0, 2), (0,), (0, 1), (1, 2))
    experts = torch.tensor([0, 0, 0, 1, 2, 2, 3, -1])
    tokens = torch.tensor([0, 1, 2, 5, 6, 7, 9, 4])
    ranks = placement.ranks_of(experts, tokens)
    # replica = token % replicas: expert 0 on (0, 2); expert 2 on (0, 1); expert 3 on (1, 2)
    assert ranks.tolist() == [0, 2, 0, 0, 0, 1, 2, -1]
    slots = placement.local_slots(experts, ranks)
    # the slot is the expert's place in its rank's list (the reference, one route at a time)
    expected = [placement.rank_experts[r].index(e) if r >= 0 else -1 for e, r in zip(experts.tolist(), ranks.tolist())]
    assert slots.tolist() == expected


def test_replicas_share_tokens_evenly():
    placement = Placement(((0, 1), (0, 2), (0, 3)))
    tokens = torch.arange(300)
    ranks = placement.ranks_of(torch.zeros(300, dtype=torch.int64), tokens)
    assert torch.bincount(ranks, minlength=3).tolist() == [100, 100, 100]


@pytest.mark.parametrize(
    "rank_experts,match",
    [((), "at least one rank"), (((0, 0), (1,)), "twice"), (((0, 2),), "missing \\[1\\]"), (((0, -1),), "negative")],
)
def test_placement_validation(rank_experts, match):
    with pytest.raises(ValueError, match=match):
        Placement(rank_experts)


def _imbalance(placement, load):
    per_rank = placement.rank_load(load)
    return float(per_rank.max() / per_rank.mean())


def test_balanced_placement_improves_skewed_load():
    # Zipf-like load over 16 experts: expert 0 alone carries more than a quarter of all routes.
    load = 1000.0 / torch.arange(1, 17, dtype=torch.float64)  # [E]
    world, slots = 4, 5  # 20 slots: 4 spare slots become replicas of the hottest experts
    contiguous = contiguous_placement(16, world)
    balanced = balanced_placement(load, world, slots)
    assert _imbalance(contiguous, load) > 2.0
    assert _imbalance(balanced, load) < 1.1
    replicas = [len(r) for r in balanced.expert_to_ranks()]
    assert all(n >= 1 for n in replicas) and sum(replicas) == world * slots
    assert replicas[0] == max(replicas) > 1  # the hottest expert is replicated
    assert all(len(r) <= slots for r in balanced.rank_experts)
    # rank_load agrees with routing real tokens through ranks_of
    routes = torch.repeat_interleave(torch.arange(16), load.round().long())  # [N] expert ids
    served = torch.bincount(balanced.ranks_of(routes, torch.arange(routes.numel())), minlength=world).double()
    torch.testing.assert_close(served, balanced.rank_load(load.round()), rtol=0.01, atol=1.0)


def test_balanced_placement_without_spare_slots_is_a_bin_pack():
    load = torch.tensor([9.0, 1, 1, 1, 8, 2, 2, 2])
    placement = balanced_placement(load, world_size=2, slots_per_rank=4)
    assert sorted(e for r in placement.rank_experts for e in r) == list(range(8))  # no replicas
    assert placement.rank_load(load).tolist() == [13.0, 13.0]  # contiguous would be 12 / 14


def test_balanced_placement_layers_and_edge_cases():
    layered = torch.tensor([[5.0, 1, 1, 1], [5.0, 1, 1, 1]])  # [L, E] summed over layers
    assert balanced_placement(layered, 2, 2) == balanced_placement(layered.sum(0), 2, 2)
    # more slots than replicas can use: at most one replica per rank, every expert everywhere
    everywhere = balanced_placement(torch.tensor([3.0, 1.0]), world_size=3, slots_per_rank=4)
    assert everywhere.rank_experts == ((0, 1), (0, 1), (0, 1))
    zero = balanced_placement(torch.zeros(6), world_size=3, slots_per_rank=2)
    assert all(len(r) == 2 for r in zero.rank_experts)
    with pytest.raises(ValueError, match="slots_per_rank"):
        balanced_placement(torch.ones(8), world_size=2, slots_per_rank=3)
    with pytest.raises(ValueError, match="load"):
        balanced_placement(-torch.ones(4), world_size=2, slots_per_rank=2)


def test_second_homes_keep_every_expert_when_any_one_rank_dies():
    base = contiguous_placement(10, 4)
    two = with_second_homes(base)
    assert two.rank_experts[1] == (3, 4, 5, 0, 1, 2)  # its own, then rank 0's in their order
    assert all(len(homes) == 2 for homes in two.expert_to_ranks())
    for dead in range(4):
        left = without_ranks(two, {dead})
        # nobody takes anything on: each survivor keeps exactly its slots
        assert left.rank_experts == tuple(r for i, r in enumerate(two.rank_experts) if i != dead)
    # with no second home the survivors take the dead rank's experts, fewest-held first
    assert without_ranks(base, {1}).rank_experts == ((0, 1, 2, 5), (6, 7, 3), (8, 9, 4))
    assert without_ranks(base, {0, 1, 2}).rank_experts == ((8, 9, 0, 1, 2, 3, 4, 5, 6, 7),)
    with pytest.raises(ValueError, match="no rank is left"):
        without_ranks(base, {0, 1, 2, 3})
    with pytest.raises(ValueError, match="at least 2 ranks"):
        with_second_homes(contiguous_placement(4, 1))


def test_a_new_rank_takes_experts_the_others_drop_and_nothing_is_lost():
    two = contiguous_placement(8, 2)
    three = with_new_rank(two)
    assert three.world_size == 3 and len(three.rank_experts[2]) == 8 // 3
    for old, new in zip(two.rank_experts, three.rank_experts):
        assert set(new) <= set(old)  # the ranks that stay only drop experts: nothing to read
    assert sorted(e for r in three.rank_experts for e in r) == list(range(8))
    assert with_new_rank(contiguous_placement(3, 2)).rank_experts == ((0,), (2,), (1,))
    with pytest.raises(ValueError, match="more than 2 experts"):
        with_new_rank(contiguous_placement(2, 2))  # every rank holds one: none to give
