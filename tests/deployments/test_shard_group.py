"""The shard group on Ray: equals the reference, survives a killed shard, feeds the router service."""

from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from deployments.router_actor import RouterService, proposed_placement, router_actor  # noqa: E402
from deployments.shard_group import ShardGroup, ShardGroupConfig  # noqa: E402
from model_shards import load_checkpoint  # noqa: E402
from moeserve.engine import LLMEngine, ModelRunner  # noqa: E402
from moeserve.sampling_params import SamplingParams  # noqa: E402
from tests.model_shards.hf_tiny import save_tiny  # noqa: E402
from tests.serve_app import local_ray  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray():
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    save_tiny("mixtral", folder)
    return folder


def reference(ckpt) -> list[list[int]]:
    runner = ModelRunner(load_checkpoint(ckpt), max_num_seqs=8, max_model_len=64)
    return [c.token_ids for c in LLMEngine(runner).generate(PROMPTS, GREEDY)]


def test_group_generates_survives_a_dead_shard_and_reports_load(ray_cluster, ckpt):
    expected = reference(ckpt)
    group = ShardGroup(ShardGroupConfig(str(ckpt), world_size=2, max_num_seqs=4, max_model_len=64, timeout_s=10))
    try:
        runner = group.start()
        assert [i["rank"] for i in group.shard_info] == [0, 1]
        full = load_checkpoint(ckpt).loaded_bytes
        assert all(i["loaded_bytes"] < full for i in group.shard_info)  # each rank reads only its experts
        engine = LLMEngine(runner)
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == expected

        # expert-load counters reach the router service (rank 0 + rank 1) and add up
        router = RouterService(runner.model.config.num_layers, runner.model.config.num_experts)
        router.report("replica-0", group.collect_stats())
        summary = router.summary()
        assert summary["layers"][0]["tokens"] > 0
        assert summary["layers"][0]["routes"] == summary["layers"][0]["tokens"] * 2
        placement = router.placement(world_size=2)
        assert sorted(e for r in placement.rank_experts for e in set(r)) == list(range(4))
        # what a re-forming group asks for: the router-service actor's proposal from the same load
        actor = router_actor(runner.model.config.num_layers, runner.model.config.num_experts)
        ray.get(actor.report.remote("replica-0", group.collect_stats()))
        assert proposed_placement(2).rank_experts == placement.rank_experts

        # kill a shard mid-generation: the step fails fast with a clear error, no hang
        engine = LLMEngine(runner)
        for p in PROMPTS:
            engine.add_request(p, GREEDY)
        engine.step()
        ray.kill(group.actors[0], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - gloo raises RuntimeError/DistBackendError
            for _ in range(20):
                engine.step()
        assert time.monotonic() - t0 < 15

        # the group re-forms (with the router's placement) and the next requests succeed
        runner = group.restart(proposed_placement(2))
        assert group.generation == 2
        assert [c.token_ids for c in LLMEngine(runner).generate(PROMPTS, GREEDY)] == expected
    finally:
        group.stop()
    assert torch.distributed.is_initialized() is False
