"""Expert placement: which rank of the shard group holds which experts.

A rank holds a list of physical expert slots. A logical expert may sit on several ranks
(replicas of a hot expert); a route to a replicated expert goes to one of its replicas chosen
by token index, so the choice is deterministic and spreads tokens evenly across replicas.

Shapes: E logical experts, W ranks (world size), S slots per rank, N routes, L layers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True)
class Placement:
    """``rank_experts[r]`` = the logical expert ids rank r holds, in local slot order."""

    rank_experts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.rank_experts:
            raise ValueError("rank_experts: needs at least one rank")
        object.__setattr__(self, "rank_experts", tuple(tuple(int(e) for e in r) for r in self.rank_experts))
        held = set()
        for rank, experts in enumerate(self.rank_experts):
            if len(set(experts)) != len(experts):
                raise ValueError(f"rank_experts: rank {rank} holds an expert twice: {experts}")
            if any(e < 0 for e in experts):
                raise ValueError(f"rank_experts: rank {rank} has a negative expert id: {experts}")
            held.update(experts)
        if held != set(range(len(held))):
            missing = sorted(set(range(max(held, default=-1) + 1)) - held)
            raise ValueError(f"rank_experts: every expert 0..E-1 needs a slot; missing {missing}")

    @property
    def world_size(self) -> int:
        return len(self.rank_experts)

    @property
    def num_experts(self) -> int:
        return 1 + max(e for r in self.rank_experts for e in r)

    def expert_to_ranks(self) -> tuple[tuple[int, ...], ...]:
        """``result[e]`` = the ranks holding expert e, ascending."""
        ranks: list[list[int]] = [[] for _ in range(self.num_experts)]
        for rank, experts in enumerate(self.rank_experts):
            for e in experts:
                ranks[e].append(rank)
        return tuple(tuple(r) for r in ranks)

    def ranks_of(self, expert_ids: Tensor, token_index: Tensor) -> Tensor:
        """Rank that serves each route: replica ``token_index % replicas(e)`` of its expert
        (expert_ids, token_index: same shape); expert id -1 (a dropped route) gives rank -1."""
        replicas, num_replicas, _ = self.tables(expert_ids.device)
        valid = expert_ids >= 0
        e = expert_ids.clamp_min(0)
        choice = token_index % num_replicas[e]
        return torch.where(valid, replicas[e, choice], -1)

    def local_slots(self, expert_ids: Tensor, ranks: Tensor) -> Tensor:
        """Slot of each expert on its rank, its index in ``rank_experts[rank]`` (-1 where rank is -1)."""
        table = self.tables(ranks.device)[2]  # [W, E]
        valid = ranks >= 0
        return torch.where(valid, table[ranks.clamp_min(0), expert_ids.clamp_min(0)], -1)

    def rank_load(self, load: Tensor) -> Tensor:
        """Expected per-rank load [W] for per-expert load [E], each replica taking an equal share."""
        load = load.double()  # [E]
        replicas = torch.tensor([len(r) for r in self.expert_to_ranks()], dtype=torch.float64)  # [E]
        share = load / replicas  # [E]
        return torch.stack([share[list(r)].sum() if r else share.new_zeros(()) for r in self.rank_experts])

    def tables(self, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
        """The lookup tables of `ranks_of` and `local_slots`, made once per device: the replicas of
        each expert [E, max replicas] (-1 past its count), the replica count of each [E], the slot
        of each expert on each rank [W, E] (-1: not held)."""
        device = torch.device(device)
        if device not in self._tables:
            self._tables[device] = tuple(t.to(device) for t in self._cpu_tables)
        return self._tables[device]

    @cached_property
    def _tables(self) -> dict:
        return {}

    @cached_property
    def _cpu_tables(self) -> tuple[Tensor, Tensor, Tensor]:
        ranks = self.expert_to_ranks()
        width = max(len(r) for r in ranks)
        replicas = torch.full((self.num_experts, width), -1, dtype=torch.int64)  # [E, max replicas]
        for e, r in enumerate(ranks):
            replicas[e, : len(r)] = torch.tensor(r)
        slots = torch.full((self.world_size, self.num_experts), -1, dtype=torch.int64)  # [W, E]
        for rank, experts in enumerate(self.rank_experts):
            for slot, e in enumerate(experts):
                slots[rank, e] = slot
        return replicas, torch.tensor([len(r) for r in ranks], dtype=torch.int64), slots


def contiguous_placement(num_experts: int, world_size: int) -> Placement:
    """Experts split into contiguous blocks, no replicas; as ``numpy.array_split``, the first
    ``num_experts % world_size`` ranks get one expert more (10 experts on 4 ranks: 3, 3, 2, 2)."""
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if num_experts < world_size:
        raise ValueError(f"num_experts: {num_experts} < world_size {world_size} would leave a rank without experts")
    base, extra = divmod(num_experts, world_size)
    blocks, start = [], 0
    for rank in range(world_size):
        size = base + (rank < extra)
        blocks.append(tuple(range(start, start + size)))
        start += size
    return Placement(tuple(blocks))


def balanced_placement(load: Tensor, world_size: int, slots_per_rank: int) -> Placement:
    """EPLB-style placement from observed per-expert load ([E], or [L, E] summed over layers:
    a rank holds the same expert ids in every layer).

    1. Replicate: every expert gets one slot; each spare slot goes to the expert with the highest
       load per replica (at most one replica per rank).
    2. Pack (greedy LPT): replicas, heaviest per-replica load first, each go to the least-loaded
       rank with a free slot that does not hold that expert yet (ties: fewer experts, then lower
       rank). A first replica always finds a slot; a later one that fits nowhere is skipped.
    """
    if load.dim() == 2:
        load = load.sum(dim=0)
    if load.dim() != 1:
        raise ValueError(f"load: expected [E] or [L, E], got shape {tuple(load.shape)}")
    if bool((load < 0).any()):
        raise ValueError("load: must be non-negative")
    num_experts = load.numel()
    if world_size < 1 or slots_per_rank < 1:
        raise ValueError(f"world_size/slots_per_rank: must be >= 1, got {world_size}/{slots_per_rank}")
    if world_size * slots_per_rank < num_experts:
        raise ValueError(f"slots_per_rank: {world_size} x {slots_per_rank} slots cannot hold {num_experts} experts")
    loads = [float(x) for x in load.double()]

    replicas = [1] * num_experts
    heap = [(-loads[e], e) for e in range(num_experts)]  # max-heap on load per replica
    heapq.heapify(heap)
    for _ in range(world_size * slots_per_rank - num_experts):
        while heap and replicas[heap[0][1]] >= world_size:
            heapq.heappop(heap)
        if not heap:
            break
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-loads[e] / replicas[e], e))

    items = sorted((-loads[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e]))
    rank_load = [0.0] * world_size
    held: list[list[int]] = [[] for _ in range(world_size)]
    for neg_share, e in items:
        open_ranks = [r for r in range(world_size) if len(held[r]) < slots_per_rank and e not in held[r]]
        if not open_ranks:
            continue
        rank = min(open_ranks, key=lambda r: (rank_load[r], len(held[r]), r))
        held[rank].append(e)
        rank_load[rank] -= neg_share
    return Placement(tuple(tuple(sorted(h)) for h in held))


def with_second_homes(placement: Placement) -> Placement:
    """Redundancy 1: every expert on at least two ranks. Rank r also holds what rank r-1 holds and
    it does not, so when any one rank dies each of its experts still has a home."""
    own = placement.rank_experts
    if len(own) < 2:
        raise ValueError("redundancy: a second home needs at least 2 ranks")
    return Placement(tuple(own[r] + tuple(e for e in own[r - 1] if e not in own[r]) for r in range(len(own))))


def without_ranks(placement: Placement, dead: set[int]) -> Placement:
    """The placement of the ranks left when `dead` are gone, renumbered in order; each survivor keeps
    its experts in their slots, and an expert left without a home goes to the survivor holding the
    fewest (which reads it from the checkpoint)."""
    kept = [list(r) for rank, r in enumerate(placement.rank_experts) if rank not in dead]
    if not kept:
        raise ValueError("without_ranks: no rank is left")
    held = {e for r in kept for e in r}
    for e in range(placement.num_experts):
        if e not in held:
            min(kept, key=len).append(e)
    return Placement(tuple(tuple(r) for r in kept))


def with_new_rank(placement: Placement) -> Placement:
    """One rank more: the new last rank takes E // (W + 1) experts, each time the last one of the
    rank holding the most, so the others only drop experts (nothing to read but the new rank's)."""
    ranks = [list(r) for r in placement.rank_experts]
    new: list[int] = []
    for _ in range(max(1, placement.num_experts // (len(ranks) + 1))):
        fullest = max(ranks, key=len)
        if len(fullest) < 2:
            raise ValueError(f"with_new_rank: {len(ranks) + 1} ranks need more than {placement.num_experts} experts")
        new.append(fullest.pop())
    return Placement(tuple(tuple(r) for r in ranks) + (tuple(sorted(new)),))
