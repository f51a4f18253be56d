"""The shard group on Ray: equals the reference, survives a killed shard, feeds the router service."""

from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from bench.serve_app import local_ray  # noqa: E402
from deployments.router_actor import RouterService, proposed_placement, router_actor  # noqa: E402
from deployments.shard_group import ShardGroup, ShardGroupConfig  # noqa: E402
from model_shards import load_checkpoint  # noqa: E402
from moeserve.engine import LLMEngine, ModelRunner  # noqa: E402
from moeserve.sampling_params import SamplingParams  # noqa: E402
from tests.model_shards.hf_tiny import save_tiny  # noqa: E402

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_gpu_shards_without_cuda_are_an_error_before_any_placement_group(ckpt):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        ShardGroupConfig(str(ckpt), gpus_per_shard=1)
    assert ShardGroupConfig(str(ckpt)).device.type == "cpu"


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


def test_served_group_moves_its_experts_live_and_stays_exact(ray_cluster, tmp_path):
    """`shards.live_replacement`: when the router service sees two experts of one rank run hot,
    the engine replica moves its running group's experts between two steps; replies before,
    during and after are exact."""
    import asyncio

    from bench.tiny_checkpoint import save_tiny_checkpoint
    from deployments.engine_server import EngineServer
    from moeserve.config import AppConfig
    from moeserve.protocol import GenerateRequest
    from router_service.gating import ExpertLoadStats

    ckpt = save_tiny_checkpoint(tmp_path)  # with a tokenizer, as a served engine needs
    expected = reference(ckpt)
    cfg = load_checkpoint(ckpt).config
    actor = router_actor(cfg.num_layers, cfg.num_experts)
    server = EngineServer(AppConfig.from_dict({
        "model": {"path": str(ckpt)}, "speculative": {"draft": "none"},
        "engine": {"max_num_seqs": 8, "max_model_len": 64, "expert_load_report_s": 0.3},
        "shards": {"num_shards": 2, "live_replacement": True, "replacement_min_gain": 0.2},
    }))  # fmt: skip

    async def replies(tag: str) -> list[list[int]]:
        async def one(i, p):
            return [t async for c in server.generate(GenerateRequest(f"{tag}{i}", tuple(p), GREEDY))
                    for t in c.token_ids]
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))

    try:
        hot = server.shard_group.placement.rank_experts[0][:2]
        skewed = ExpertLoadStats(cfg.num_layers, cfg.num_experts)
        skewed.route_counts[:, list(hot)] = 10_000
        ray.get(actor.report.remote("skewed-replica", [skewed.to_dict()]))
        deadline = time.monotonic() + 30
        while asyncio.run(server.stats())["expert_replacements"] < 1 and time.monotonic() < deadline:
            assert asyncio.run(replies("during")) == expected  # the move lands between these steps
        stats = asyncio.run(server.stats())
        assert stats["expert_replacements"] == 1 and stats["step_errors"] == 0
        after = server.shard_group.placement
        assert not any(set(hot) <= set(r) for r in after.rank_experts)  # the hot pair is split
        assert [i["experts"] for i in server.shard_group.shard_info] == [list(r) for r in after.rank_experts]
        assert asyncio.run(replies("after")) == expected
    finally:
        server.shutdown()
        server.shard_group.stop()
        ray.kill(actor)


@pytest.mark.parametrize("redundancy", [1, 0])
def test_a_killed_rank_leaves_the_others_serving_without_a_restart(ray_cluster, tmp_path, redundancy):
    """`shards.redundancy`: a rank killed mid-generation; the live ranks form the group again among
    themselves (the same actors: no process started, and with a second home for every expert no
    weights read) and every reply is exactly the fault-free one, during and after."""
    import asyncio

    from bench.tiny_checkpoint import save_tiny_checkpoint
    from deployments.engine_server import EngineServer
    from moeserve.config import AppConfig
    from moeserve.protocol import GenerateRequest

    ckpt = save_tiny_checkpoint(tmp_path)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    runner = ModelRunner(load_checkpoint(ckpt), max_num_seqs=8, max_model_len=64)
    expected = [c.token_ids for c in LLMEngine(runner).generate(PROMPTS, params)]
    server = EngineServer(AppConfig.from_dict({
        "model": {"path": str(ckpt)}, "speculative": {"draft": "none"},
        "engine": {"max_num_seqs": 6, "max_model_len": 64, "expert_load_report_s": 0},
        "shards": {"num_shards": 3, "redundancy": redundancy, "min_shards": 2},  # 2: no replacement rank
    }))  # fmt: skip
    group = server.shard_group
    survivor = group.actors[0]  # rank 1 lives; rank 2 is killed
    homes = group.placement.expert_to_ranks()
    assert all(len(h) >= 1 + redundancy for h in homes)  # (the router service may add replicas)

    async def replies(tag: str, kill: bool) -> list[list[int]]:
        started = asyncio.Event()

        async def one(i, p):
            out = []
            async for c in server.generate(GenerateRequest(f"{tag}{i}", tuple(p), params)):
                out += c.token_ids
                started.set()
            return out

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(PROMPTS)]
        if kill:
            await started.wait()
            ray.kill(group.actors[1], no_restart=True)
        return list(await asyncio.gather(*tasks))

    try:
        assert asyncio.run(replies("during", kill=True)) == expected
        stats = asyncio.run(server.stats())
        assert stats["finished"].get("error", 0) == 0
        assert {k: v for k, v in stats["shard_group"].items() if k != "last_recovery_s"} == {
            "width": 2, "generation": 2, "resizes": 0, "rank_failures_survived": 1}
        assert group.actors == [survivor] and [i["rank"] for i in group.shard_info] == [0, 1]
        assert sorted({e for r in group.placement.rank_experts for e in r}) == list(range(len(homes)))
        assert asyncio.run(replies("after", kill=False)) == expected
    finally:
        server.shutdown()
        group.stop()


def test_the_group_widens_narrows_and_takes_a_replacement_rank_mid_generation(ray_cluster, tmp_path):
    """Elastic width: 2 -> 3 -> 2 ranks while requests run, then rank 1 killed: rank 0 serves on
    alone until a replacement rank has loaded and joins (min_shards 2). Every reply is exactly the
    fault-free one; a new rank reads only its experts, and the ranks that stay keep their process."""
    import asyncio

    from bench.tiny_checkpoint import save_tiny_checkpoint
    from deployments.engine_server import EngineServer
    from moeserve.config import AppConfig
    from moeserve.protocol import GenerateRequest

    ckpt = save_tiny_checkpoint(tmp_path)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    runner = ModelRunner(load_checkpoint(ckpt), max_num_seqs=8, max_model_len=64)
    expected = [c.token_ids for c in LLMEngine(runner).generate(PROMPTS, params)]
    server = EngineServer(AppConfig.from_dict({
        "model": {"path": str(ckpt)}, "speculative": {"draft": "none"},
        "engine": {"max_num_seqs": 6, "max_model_len": 64, "expert_load_report_s": 0},
        "shards": {"num_shards": 2, "max_shards": 3, "resize_after_s": 1000},  # widths by hand only
    }))  # fmt: skip
    group = server.shard_group
    first = group.actors[0]

    async def replies(tag: str, during) -> list[list[int]]:
        started = asyncio.Event()

        async def one(i, p):
            out = []
            async for c in server.generate(GenerateRequest(f"{tag}{i}", tuple(p), params)):
                out += c.token_ids
                started.set()
            return out

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(PROMPTS)]
        await started.wait()
        during()
        return list(await asyncio.gather(*tasks))

    def rounds(tag: str, during, until) -> None:
        """Rounds of the four requests, each exact, until `until()` (a new rank loads for seconds)."""
        deadline = time.monotonic() + 60
        for n in range(1000):
            assert asyncio.run(replies(f"{tag}{n}", during)) == expected
            if until():
                return
            assert time.monotonic() < deadline, f"{tag}: still {group.width} ranks"
            during = lambda: None  # noqa: E731

    try:
        rounds("wide", lambda: server.resize(3), lambda: group.width == 3)
        assert group.actors[0] is first and len(group.shard_info) == 3
        assert group.shard_info[2]["loaded_bytes"] < load_checkpoint(ckpt).loaded_bytes  # its experts only
        assert sorted({e for r in group.placement.rank_experts for e in r}) == list(range(group.num_experts))
        rounds("narrow", lambda: server.resize(2), lambda: group.width == 2)
        assert group.actors == [first] and group.resizes == 2

        rounds("kill", lambda: ray.kill(first, no_restart=True), lambda: group.width == 2)  # 1 rank, then 2
        stats = asyncio.run(server.stats())
        assert stats["shard_group"]["width"] == 2 and stats["shard_group"]["rank_failures_survived"] == 1
        assert stats["shard_group"]["resizes"] == 3 and stats["finished"].get("error", 0) == 0
        assert group.actors[0] is not first
        core = server.core.core
        assert stats["step_errors"] >= 1 and not core.isolation.suspects  # the group failed, no request was run alone
        assert core.engine.scheduler.focus is None
    finally:
        server.shutdown()
        group.stop()


def test_a_rank_that_stops_answering_is_dropped_after_the_collective_timeout(ray_cluster, ckpt):
    """A peer frozen mid-generation (SIGSTOP: alive, silent) fails the step within the group's
    timeout, never a hang; it does not answer its health check either, so the others re-form
    without it and the requests finish exactly as the fault-free run."""
    import os
    import signal

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runner = ModelRunner(load_checkpoint(ckpt), max_num_seqs=8, max_model_len=64)
    expected = [c.token_ids for c in LLMEngine(runner).generate(PROMPTS, params)]
    group = ShardGroup(ShardGroupConfig(str(ckpt), world_size=3, max_num_seqs=4, max_model_len=64, timeout_s=3))
    try:
        engine = LLMEngine(group.start())
        ids = [engine.add_request(p, params) for p in PROMPTS]
        tokens = {i: [] for i in ids}

        def step() -> None:
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids

        step()
        frozen = group.actors[1]
        os.kill(ray.get(frozen.health.remote())["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - gloo's timeout: RuntimeError/DistBackendError
            step()
        assert time.monotonic() - t0 < 3 * 3
        engine.requeue([s.seq_id for s in engine.scheduler.running])
        engine.runner = group.recover()  # the frozen rank's health check times out too: it is killed
        assert group.width == 2 and frozen not in group.actors and group.rank_failures_survived == 1
        while engine.has_unfinished():
            step()
        assert [tokens[i] for i in ids] == expected
    finally:
        group.stop()
