"""RouterService (the router-service actor's class) without Ray: merging reports, placement,
and a redeploy with a model of another shape."""

from __future__ import annotations

import torch

from deployments.router_actor import RouterService
from router_service.gating import ExpertLoadStats


def counters(num_layers: int, num_experts: int, hot: int, tokens: int) -> dict:
    stats = ExpertLoadStats(num_layers, num_experts)
    stats.route_counts[:, hot] = tokens
    stats.tokens[:] = tokens
    return stats.to_dict()


def test_reports_merge_replace_per_source_and_reset_on_a_new_shape():
    router = RouterService(2, 4)
    assert router.placement(2).rank_experts == ((0, 1), (2, 3))  # no load yet: contiguous
    router.report("engine-a", [counters(2, 4, hot=0, tokens=10)])
    router.report("engine-b", [counters(2, 4, hot=1, tokens=5), counters(2, 4, hot=1, tokens=5)])
    router.report("engine-a", [counters(2, 4, hot=0, tokens=30)])  # cumulative: replaces, never adds
    merged = router.merged()
    assert merged.route_counts[0].tolist() == [30, 10, 0, 0]
    assert router.summary()["sources"] == ["engine-a", "engine-b"]
    hot = router.placement(2).rank_experts
    assert 0 in hot[0] + hot[1] and not ({0, 1} <= set(hot[0]) or {0, 1} <= set(hot[1]))  # hot experts split
    router.report("engine-c", [counters(3, 8, hot=5, tokens=7)])  # another model now
    assert (router.num_layers, router.num_experts) == (3, 8)
    assert router.summary()["sources"] == ["engine-c"]
    assert torch.equal(router.merged().route_counts[:, 5], torch.full((3,), 7))
