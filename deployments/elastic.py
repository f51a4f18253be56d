"""A shard group's controls for the engine core, used between steps: recover after a failed step,
live re-placement, and elastic width (when the group widens or narrows).

The width follows the load (sequences running and waiting): `ceil(load / (max_num_seqs /
max_shards))` ranks, between `min_shards` and `max_shards`, once that target has held for
`resize_after_s` seconds (hysteresis: a burst does not resize the group). A group below `min_shards` (a
rank died) grows back as soon as a new rank has loaded. Growing goes one rank at a time; the new
rank loads its weights beside the serving group while the target holds (`ShardGroup.
prepare_growth`), so the group pauses only to re-form. Narrowing drops the last rank. `request`
sets a width by hand (tests, benches, an operator); the load rules take over once it is reached.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from moeserve.config import ShardsSection
from router_service.placement import Placement


class ElasticGroup:
    def __init__(self, group: Any, shards: ShardsSection, max_num_seqs: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.group, self.shards, self.clock = group, shards, clock
        self.min, self.max = shards.min_shards or shards.num_shards, shards.max_shards or shards.num_shards
        self.per_rank = max_num_seqs / self.max  # sequences a rank serves at full width
        self.target, self.since = group.width, clock()
        self.requested: int | None = None

    def recover(self) -> Any:
        """The group without its dead ranks (a fresh one, placed as the router service proposes
        now, when none died); returns its runner."""
        from deployments.router_actor import proposed_placement

        return self.group.recover(lambda: proposed_placement(self.shards.num_shards))

    @property
    def rank_failures(self) -> int:
        return self.group.rank_failures_survived

    def replace(self, rank_experts: tuple[tuple[int, ...], ...]) -> None:
        self.group.replace(Placement(rank_experts))

    def expert_load(self) -> list[dict[str, Any]]:
        return self.group.collect_stats()

    def request(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"width: must be >= 1, got {width}")
        self.requested = width

    def wanted(self, load: int) -> int:
        if self.requested is not None:
            return self.requested
        return min(self.max, max(self.min, math.ceil(load / self.per_rank)))

    def due(self, waiting: int, running: int) -> bool:
        """Whether the group should change width now (called between steps: cheap unless it should)."""
        width, now = self.group.width, self.clock()
        target = self.wanted(waiting + running)
        if target != self.target:
            self.target, self.since = target, now
        if target <= width:
            self.group.cancel_growth()
        if target == width:
            self.requested = None
            return False
        held = now - self.since >= self.shards.resize_after_s or self.requested is not None
        if target > width:  # the new rank loads while the target holds
            return self.group.prepare_growth() and (held or width < self.min)
        return held

    def apply(self) -> Any:
        """One rank toward the target; returns the group's new runner."""
        width = self.group.width
        return self.group.resize(width + 1 if self.target > width else width - 1)
