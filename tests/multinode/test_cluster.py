"""Shard groups and the served app across the nodes of a Ray cluster (three raylets on this
machine, bench/cluster.py): STRICT_SPREAD puts every rank, rank 0 included, on a node of its own,
STRICT_PACK every rank on rank 0's node; deployments land where their `resources` pin them; greedy
output stays the single-process reference's. One cluster for the module, shut down at the end."""

from __future__ import annotations

import time

import httpx
import pytest

ray = pytest.importorskip("ray")

from bench.cluster import local_cluster  # noqa: E402
from bench.serve_app import serve_on_ray  # noqa: E402
from bench.tiny_checkpoint import MODEL_NAME, save_tiny_checkpoint  # noqa: E402
from deployments.shard_group import ShardGroup, ShardGroupConfig  # noqa: E402
from model_shards import load_checkpoint  # noqa: E402
from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.engine import LLMEngine, ModelRunner  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
TEXT_PROMPTS = ["The bakery sells", "Order: two loaves", "Hello my"]
PIN = 0.01  # of a node's own resource: enough to pin a deployment to it


@pytest.fixture(scope="module")
def nodes():
    with local_cluster() as ids:
        yield ids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


def test_strict_spread_puts_every_rank_on_its_own_node(nodes, ckpt, one_torch_thread):
    runner = ModelRunner(load_checkpoint(ckpt), max_num_seqs=4, max_model_len=64)
    expected = [c.token_ids for c in LLMEngine(runner).generate(PROMPTS, GREEDY)]
    group = ShardGroup(ShardGroupConfig(str(ckpt), world_size=3, max_num_seqs=2, max_model_len=64,
                                        strategy="STRICT_SPREAD", timeout_s=20))
    try:
        runner = group.start()
        rank_nodes = [i["node_id"] for i in group.shard_info]
        assert rank_nodes[0] == nodes["node_head"]  # rank 0 is this driver's process
        assert sorted(rank_nodes) == sorted(nodes.values())  # one rank per node
        assert [h["node_id"] for h in group.health()] == rank_nodes
        assert [c.token_ids for c in LLMEngine(runner).generate(PROMPTS, GREEDY)] == expected
    finally:
        group.stop()


def test_strict_pack_keeps_every_rank_on_rank0s_node(nodes, ckpt):
    group = ShardGroup(ShardGroupConfig(str(ckpt), world_size=2, max_num_seqs=2, max_model_len=64,
                                        strategy="STRICT_PACK", timeout_s=20))
    try:
        group.start()
        assert [i["node_id"] for i in group.shard_info] == [nodes["node_head"]] * 2
    finally:
        group.stop()


def test_served_app_across_nodes_answers_as_the_reference(nodes, ckpt):
    """Gateway pinned to node_w2, the engine replica (rank 0) to node_w1, its rank 1 wherever
    STRICT_SPREAD puts it: not node_w1. Greedy text equals the offline engine's."""
    from deployments.app import APP_NAME, build_app

    def build(grpc_port: int) -> tuple:
        one = {"num_replicas": 1, "num_cpus": 0.5}
        config = {
            "model": {"path": str(ckpt), "name": MODEL_NAME},
            "engine": {"max_num_seqs": 4, "max_model_len": 64, "expert_load_report_s": 0},
            "speculative": {"draft": "none"},
            "shards": {"num_shards": 2, "strategy": "STRICT_SPREAD"},
            "gateway": {"grpc_port": grpc_port, "grpc_host": "127.0.0.1"},
            "deployments": {"gateway": {**one, "max_ongoing_requests": 16, "resources": {"node_w2": PIN}},
                            "engine": {**one, "max_ongoing_requests": 16, "resources": {"node_w1": PIN}}},
        }
        return build_app(config), APP_NAME, "/"

    with serve_on_ray(build, proxy_location="HeadOnly", healthy_s=180) as urls:
        held = ray.available_resources()
        assert held.get("node_w1", 0) < 1 and held.get("node_w2", 0) < 1  # both deployments sit where pinned
        shards = httpx.get(f"{urls['http']}/health", timeout=30).json()["engine"]["shards"]
        assert [s["rank"] for s in shards] == [0, 1] and all(s["alive"] for s in shards)
        assert shards[0]["node_id"] == nodes["node_w1"]  # rank 0 runs in the engine replica
        assert shards[1]["node_id"] in nodes.values() and shards[1]["node_id"] != nodes["node_w1"]
        served = [httpx.post(f"{urls['http']}/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        }).json()["choices"][0]["text"] for p in TEXT_PROMPTS]  # fmt: skip
    offline = LLM(str(ckpt), "none", max_num_seqs=4, max_model_len=64).generate(TEXT_PROMPTS, GREEDY)
    assert served == [o.text for o in offline]


def test_a_removed_node_takes_its_rank_and_a_replacement_joins_on_another(nodes, ckpt):
    """Rank 1's node removed mid-generation (its raylet and processes killed, as when a machine is
    lost): rank 0 serves on alone, and a replacement rank loads on a node STRICT_SPREAD allows
    and joins (min_shards 2). Exact throughout. Runs last: it replaces a node of the module's cluster."""
    from deployments.elastic import ElasticGroup
    from moeserve.config import ShardsSection

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runner = ModelRunner(load_checkpoint(ckpt), max_num_seqs=4, max_model_len=64)
    expected = [c.token_ids for c in LLMEngine(runner).generate(PROMPTS, params)]
    group = ShardGroup(ShardGroupConfig(str(ckpt), world_size=2, max_num_seqs=2, max_model_len=64,
                                        strategy="STRICT_SPREAD", timeout_s=10))
    elastic = ElasticGroup(group, ShardsSection(num_shards=2), max_num_seqs=4)
    try:
        engine = LLMEngine(group.start())
        ids = [engine.add_request(p, params) for p in PROMPTS]
        tokens = {i: [] for i in ids}
        lost = next(name for name, node in nodes.items() if node == group.shard_info[1]["node_id"])

        def step() -> None:
            try:
                for o in engine.step():
                    tokens[o.request_id] += o.new_token_ids
            except Exception:  # what the engine core does after a failed step
                engine.requeue([s.seq_id for s in engine.scheduler.running])
                engine.runner = elastic.recover()

        step()
        nodes.remove(lost)
        deadline = time.monotonic() + 30
        while _alive(group.actors[0]):  # the node's processes die a moment later: until then steps succeed
            assert time.monotonic() < deadline, "rank 1 outlived its node"
            time.sleep(0.1)
        deadline = time.monotonic() + 60
        while group.generation == 1:  # a step fails (at once, or at the collective timeout): re-formed
            assert time.monotonic() < deadline and engine.has_unfinished()
            step()
        assert group.width == 1 and group.rank_failures_survived == 1
        step()
        nodes.add(lost, 2)
        deadline = time.monotonic() + 90
        while group.width < 2:  # the replacement loads on the new node, then joins between steps
            assert time.monotonic() < deadline, "no replacement rank joined"
            if elastic.due(0, len(engine.scheduler.running)):
                engine.requeue([s.seq_id for s in engine.scheduler.running])
                engine.runner = elastic.apply()
            if engine.has_unfinished():
                step()
            else:
                time.sleep(0.2)
        assert group.shard_info[1]["node_id"] in set(nodes.values()) - {nodes["node_head"]}
        while engine.has_unfinished():
            step()
        assert [tokens[i] for i in ids] == expected
    finally:
        group.stop()


def _alive(actor) -> bool:
    import ray

    try:
        ray.get(actor.health.remote(), timeout=1.0)
        return True
    except Exception:  # dead (or not answering: as good as dead to a collective)
        return False
