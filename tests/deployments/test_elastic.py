"""Elastic width's decisions (deployments/elastic.py) against a fake group and a fake clock."""

from __future__ import annotations

import pytest

from deployments.elastic import ElasticGroup
from moeserve.config import ShardsSection


class FakeGroup:
    def __init__(self, width: int, load_polls: int = 0) -> None:
        self.width, self.load_polls, self.prepared, self.cancelled = width, load_polls, 0, 0

    def prepare_growth(self) -> bool:
        self.prepared += 1
        return self.prepared > self.load_polls  # loaded after `load_polls` polls

    def cancel_growth(self) -> None:
        self.cancelled += 1

    def resize(self, width: int) -> str:
        assert abs(width - self.width) == 1
        self.width = width
        return f"runner{width}"


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def policy(group, lo=2, hi=4, seqs=16, after=10.0):
    clock = Clock()
    shards = ShardsSection(num_shards=lo, min_shards=lo, max_shards=hi, resize_after_s=after)
    return ElasticGroup(group, shards, seqs, clock), clock


def test_width_follows_the_load_once_it_has_held():
    group = FakeGroup(2)
    elastic, clock = policy(group)  # 4 sequences a rank at full width
    assert not elastic.due(waiting=0, running=8)  # 2 ranks wanted: as now
    assert not elastic.due(waiting=4, running=8)  # 3 wanted, not held yet; the new rank loads meanwhile
    assert group.prepared == 1
    clock.now = 9.9
    assert not elastic.due(waiting=4, running=8)
    clock.now = 10.0
    assert elastic.due(waiting=4, running=8) and elastic.apply() == "runner3"
    assert not elastic.due(waiting=4, running=8)  # reached
    clock.now = 11.0
    assert not elastic.due(waiting=0, running=1)  # min_shards 2 wanted: held from now
    clock.now = 20.9
    assert not elastic.due(waiting=0, running=1)
    clock.now = 21.0
    assert elastic.due(waiting=0, running=1) and elastic.apply() == "runner2"


def test_a_burst_shorter_than_the_hold_does_not_resize_and_stops_the_loading_rank():
    group = FakeGroup(2)
    elastic, clock = policy(group)
    assert not elastic.due(0, 16)  # 4 wanted
    clock.now = 5.0
    assert not elastic.due(0, 6)  # back to 2 before it held
    assert group.cancelled >= 1
    clock.now = 30.0
    assert not elastic.due(0, 6) and group.width == 2


def test_below_min_shards_a_loaded_replacement_joins_without_waiting_for_the_hold():
    group = FakeGroup(1, load_polls=2)  # a rank died: 1 of min 2
    elastic, _ = policy(group)
    assert not elastic.due(0, 0) and not elastic.due(0, 0)  # loading
    assert elastic.due(0, 0) and elastic.apply() == "runner2"


def test_a_requested_width_goes_one_rank_at_a_time_then_the_load_rules_again():
    group = FakeGroup(2)
    elastic, clock = policy(group, hi=2)
    elastic.request(4)  # beyond max_shards, by hand
    for width in (3, 4):
        assert elastic.due(0, 0)
        elastic.apply()
        assert group.width == width
    assert not elastic.due(0, 0)  # reached: the request is done
    clock.now = 10.0
    assert not elastic.due(0, 0)  # the load's target (2) holds from now
    clock.now = 20.0
    assert elastic.due(0, 0) and elastic.apply() == "runner3"
    with pytest.raises(ValueError, match="width"):
        elastic.request(0)
