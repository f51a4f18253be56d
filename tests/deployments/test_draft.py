"""The draft deployment: same greedy tokens as the target alone through Serve, pre-drafts that
are what drafting then would give, and the engine carries on without drafts when the deployment
is slow or gone, drafting again once its worker is back."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from bench.serve_app import local_ray  # noqa: E402
from deployments.draft import DraftProcess, RemoteDraftProposer, bind_draft  # noqa: E402
from deployments.draft_channel import ChannelServer  # noqa: E402
from deployments.draft_worker import DraftServerConfig, DraftWorker  # noqa: E402
from model_shards import load_checkpoint  # noqa: E402
from model_shards.local_group import free_port  # noqa: E402
from moeserve.engine.draft_model import DraftModelProposer  # noqa: E402
from moeserve.protocol import DraftCall  # noqa: E402
from moeserve.sampling_params import SamplingParams  # noqa: E402
from moeserve.spec import Proposal, ProposalRequest  # noqa: E402
from tests.model_shards.hf_tiny import save_tiny  # noqa: E402
from tests.spec.tiny_pair import make_engine, noisy_copy, random_prompts, run  # noqa: E402

PROMPTS = [p * 2 for p in random_prompts(6, 96, seed=7, lengths=(3, 16))]
PARAMS = [SamplingParams(max_tokens=8 + 2 * i, temperature=0.0) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A target and a draft that agrees with it often (a noisy copy, saved as a checkpoint)."""
    target_dir = tmp_path_factory.mktemp("target")
    save_tiny("mixtral", target_dir)
    target = load_checkpoint(target_dir)
    draft_dir = tmp_path_factory.mktemp("draft")
    hf = save_tiny("mixtral", draft_dir)  # same weights, then perturbed like tiny_pair.noisy_copy
    noisy = noisy_copy(target, 0.02)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            ours = dict(noisy.named_parameters()).get(name)
            if ours is not None and ours.shape == p.shape:
                p.copy_(ours)
    hf.save_pretrained(draft_dir)
    plain = run(make_engine(target), PROMPTS, PARAMS)
    return target, str(draft_dir), plain


@pytest.fixture(scope="module")
def ray_cluster():
    """Yields the HTTP base URL (a free port: not another test worker's 8000)."""
    with local_ray():
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"


def config(path: str) -> DraftServerConfig:
    return DraftServerConfig(model_path=path, max_num_seqs=8, max_model_len=96, torch_threads=1)


# ---- without Ray -------------------------------------------------------------------------------
def test_draft_worker_is_the_in_process_proposer(ckpts):
    _, draft_dir, _ = ckpts
    server = DraftWorker(config(draft_dir))
    local = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)
    reqs = [ProposalRequest(f"s{i}", p, 4) for i, p in enumerate(PROMPTS)]
    assert [p.token_ids for p in server.propose(DraftCall(reqs))] == [p.token_ids for p in local.propose(reqs)]
    server.propose(DraftCall([], finished=["s0", "s1"]))
    assert server.stats()["tracked_seqs"] == len(PROMPTS) - 2


def serve_channel(handle, after=lambda msg, reply: None) -> ChannelServer:
    return ChannelServer(handle, after, ("127.0.0.1", 0), b"secret")


def test_channel_round_trip_secret_and_timeout():
    """One reply per message; the after-hook runs once the reply is sent; a wrong secret is refused;
    a call without a reply in time falls back and the proposer connects afresh after its pause."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    after, replies = [], [[Proposal([7, 8])], "slow", [Proposal([9])]]

    def handle(call):
        reply = replies.pop(0)
        if reply == "slow":
            time.sleep(0.5)
            return [Proposal([1])]
        return reply

    server = serve_channel(handle, lambda msg, reply: after.append(reply))
    with pytest.raises(AuthenticationError):
        Client(server.address, authkey=b"not the secret")
    proposer = RemoteDraftProposer((server.address, b"secret"), timeout_s=0.2, backoff_s=0.05)
    req = [ProposalRequest("a", [1, 2, 3], 2), ProposalRequest("b", [4], 0)]
    assert [p.token_ids for p in proposer.propose(req)] == [[7, 8], []]
    deadline = time.monotonic() + 5
    while not after and time.monotonic() < deadline:  # the hook runs once the reply is sent
        time.sleep(0.001)
    assert after == [[Proposal([7, 8])]]
    proposer.on_finished("gone")
    assert [p.token_ids for p in proposer.propose(req)] == [[], []]  # timed out
    assert [p.token_ids for p in proposer.propose(req)] == [[], []]  # backing off: no call
    time.sleep(0.06)
    assert [p.token_ids for p in proposer.propose(req)] == [[9], []]  # a new connection
    stats = proposer.stats()
    assert stats.pop("wait_s") >= 0 and stats.pop("wait_s_per_call") >= 0
    assert stats == {"calls": 3, "proposals": 2, "predraft_hits": 0, "predraft_hit_rate": 0.0,
                     "fallback_steps": 2, "timeouts": 1, "errors": 0}


def test_a_failed_call_resends_its_finished_sequences():
    calls = []

    def handle(call):
        calls.append(call)
        if len(calls) == 1:
            raise RuntimeError("a bug in the worker: the connection is dropped")
        return [Proposal([5]) for _ in call.requests]

    server = serve_channel(handle)
    proposer = RemoteDraftProposer((server.address, b"secret"), timeout_s=5.0, backoff_s=0.0)
    proposer.on_finished("old")
    assert [p.token_ids for p in proposer.propose([ProposalRequest("a", [1, 2], 1)])] == [[]]
    assert [p.token_ids for p in proposer.propose([ProposalRequest("a", [1, 2], 1)])] == [[5]]
    assert [c.finished for c in calls] == [[f"{proposer.session}/old"]] * 2
    assert [r.seq_id for r in calls[1].requests] == [f"{proposer.session}/a"]
    assert proposer.num_errors == 1


def test_predrafted_proposals_are_what_drafting_then_would_give(ckpts):
    """A hit (the next call brings the history pre-drafted for: every draft accepted, the draft's own
    next token as the bonus) answers with the tokens a fresh draft gives for it; a miss drafts anew."""
    _, draft_dir, _ = ckpts
    worker = DraftWorker(config(draft_dir))
    fresh = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)
    reqs = [ProposalRequest(f"s{i}", p, 3) for i, p in enumerate(PROMPTS[:2])]
    call = DraftCall(reqs)
    first = worker.propose(call)
    worker.predraft(call, first)
    guess = fresh.propose([ProposalRequest("g", reqs[0].token_ids + first[0].token_ids, 1)])[0].token_ids
    wrong = next(t for t in range(2, 90) if t != fresh.propose([ProposalRequest(
        "h", reqs[1].token_ids + first[1].token_ids, 1)])[0].token_ids[0])
    nxt = [ProposalRequest("s0", reqs[0].token_ids + first[0].token_ids + guess, 3),
           ProposalRequest("s1", reqs[1].token_ids + first[1].token_ids + [wrong], 3)]
    got = worker.propose(DraftCall(nxt))
    want = [fresh.propose([ProposalRequest(f"f{i}", r.token_ids, 3)])[0].token_ids for i, r in enumerate(nxt)]
    assert [p.token_ids for p in got] == want and [p.predrafted for p in got] == [True, False]
    assert worker.num_predraft_hits == 1 and worker.num_predrafts == 1


def test_draft_process_pins_answers_and_comes_back_at_its_address_after_a_kill(ckpts):
    """The worker in its own process: proposes what the in-process proposer does over its channel,
    runs on the CPUs it was given, and a new process on the same address replaces a killed one, so
    the engine's proposer drafts again by reconnecting."""
    import os

    _, draft_dir, _ = ckpts
    cpu = max(os.sched_getaffinity(0))
    proc = DraftProcess(replace(config(draft_dir), cpus=(cpu,)))
    try:
        local = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)
        reqs = [ProposalRequest(f"s{i}", p, 4) for i, p in enumerate(PROMPTS)]
        want = [p.token_ids for p in local.propose(reqs)]
        proposer = RemoteDraftProposer((proc.address, proc.authkey), timeout_s=30.0, backoff_s=0.0)
        assert [p.token_ids for p in proposer.propose(reqs)] == want
        first = proc.stats()
        assert first["cpus"] == [cpu] and first["calls"] == 1 and first["restarts"] == 0
        proc.check()
        address = proc.address
        proc.kill()
        assert [p.token_ids for p in proposer.propose(reqs)] == [[]] * len(reqs)  # the worker is gone
        deadline = time.monotonic() + 60
        while proc.restarts == 0 or not proc._ready.is_set():
            assert time.monotonic() < deadline, "the worker process was not restarted"
            time.sleep(0.05)
        assert proc.address == address and proc.pid != first["pid"] and proc.stats()["calls"] == 0
        proc.check()
        assert [p.token_ids for p in proposer.propose(reqs)] == want
    finally:
        proc.close()


def test_a_draft_process_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="did not start"):
        DraftProcess(config(str(tmp_path / "no-such-checkpoint")), start_timeout_s=60)


def test_the_draft_deployments_counters_reach_metrics(ckpts):
    """The engine core reports its proposer's counters (pre-draft hits, time waited for drafts,
    fallbacks), and /metrics shows them as moeserve_engine{name="draft_..."}."""
    from deployments.metrics import GatewayMetrics
    from moeserve.engine.core import EngineCore

    target, _, _ = ckpts
    server = serve_channel(lambda call: [Proposal([7, 8], predrafted=True), Proposal([9])])
    proposer = RemoteDraftProposer((server.address, b"secret"), timeout_s=5.0)
    proposer.propose([ProposalRequest("a", [1, 2], 2), ProposalRequest("b", [3], 1)])
    stats = EngineCore(make_engine(target, proposer, k=2)).stats()["draft"]
    assert (stats["calls"], stats["proposals"], stats["predraft_hits"], stats["predraft_hit_rate"]) == (1, 2, 1, 0.5)
    text = GatewayMetrics().render({"draft": stats}).decode()
    assert 'moeserve_engine{name="draft_predraft_hit_rate"} 0.5' in text
    assert 'moeserve_engine{name="draft_wait_s_per_call"}' in text


# ---- through Serve -----------------------------------------------------------------------------
def channel_of(handle):
    return handle.options(method_name="channel").remote().result(timeout_s=30)


def test_served_draft_gives_the_target_greedy_tokens(ray_cluster, ckpts):
    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir)), name="draft-one", route_prefix=None)
    proposer = RemoteDraftProposer(channel_of(handle), timeout_s=30.0)
    engine = make_engine(target, proposer, k=4)
    assert run(engine, PROMPTS, PARAMS) == plain
    assert proposer.num_fallback_steps == 0 and proposer.num_calls == engine.spec_metrics.num_steps
    assert engine.spec_metrics.alpha > 0.2
    stats = handle.options(method_name="stats").remote().result(timeout_s=30)
    assert stats["calls"] == proposer.num_calls and stats["channel_connections"] == 1
    assert stats["predrafts"] > 0
    serve.delete("draft-one")


def test_a_draft_that_is_always_right_is_answered_from_its_predrafts(ray_cluster, ckpts, tmp_path):
    """The target as its own draft: every draft is accepted and the bonus token is the draft's own
    next one, so calls find their proposals drafted while the target verified the previous one."""
    target, _, plain = ckpts
    save_tiny("mixtral", tmp_path)  # the same weights as the target
    handle = serve.run(bind_draft(config(str(tmp_path))), name="draft-same", route_prefix=None)
    proposer = RemoteDraftProposer(channel_of(handle), timeout_s=30.0)
    engine = make_engine(target, proposer, k=2)
    assert run(engine, PROMPTS, PARAMS) == plain
    assert engine.spec_metrics.alpha == 1.0
    stats = handle.options(method_name="stats").remote().result(timeout_s=30)
    mine = proposer.stats()  # the engine's side counts the same hits, for /metrics
    assert stats["predraft_hits"] == mine["predraft_hits"] > 0 and mine["predraft_hit_rate"] > 0
    serve.delete("draft-same")


def test_two_replicas_each_engine_on_its_own(ray_cluster, ckpts):
    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir), {"num_replicas": 2}), name="draft-two", route_prefix=None)
    for _ in range(2):
        proposer = RemoteDraftProposer(channel_of(handle), timeout_s=30.0)
        assert run(make_engine(target, proposer, k=4), PROMPTS, PARAMS) == plain
        assert proposer.num_fallback_steps == 0
    serve.delete("draft-two")


def test_slow_draft_times_out_and_the_request_completes(ray_cluster, ckpts):
    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir)), name="draft-slow", route_prefix=None)
    proposer = RemoteDraftProposer(channel_of(handle), timeout_s=1e-4, backoff_s=0.0, max_backoff_s=0.0)
    engine = make_engine(target, proposer, k=4)
    assert run(engine, PROMPTS, PARAMS) == plain
    assert proposer.num_timeouts > 0 and proposer.num_fallback_steps >= proposer.num_timeouts
    serve.delete("draft-slow")


def run_failing_midway(engine, steps: int, fail) -> list[list[int]]:
    """Decode PROMPTS for `steps` steps, call `fail()`, then run to the end; tokens per prompt."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    out = {rid: [] for rid in ids}
    done = 0
    while engine.has_unfinished():
        if done == steps:
            fail()
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        done += 1
    assert done > steps, "finished before the failure"
    return [out[rid] for rid in ids]


def test_deleted_draft_deployment_falls_back(ray_cluster, ckpts):
    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir)), name="draft-gone", route_prefix=None)
    proposer = RemoteDraftProposer(channel_of(handle), timeout_s=2.0, backoff_s=0.2)
    t0 = {}

    def delete():
        assert proposer.num_calls > 0 and proposer.num_fallback_steps == 0  # it drafted until now
        serve.delete("draft-gone")
        t0["deleted"] = time.monotonic()

    assert run_failing_midway(make_engine(target, proposer, k=4), 4, delete) == plain
    assert proposer.num_fallback_steps > 0
    assert time.monotonic() - t0["deleted"] < 60


def test_killed_draft_worker_falls_back_and_is_restarted(ray_cluster, ckpts):
    """SIGKILL the replica's worker process mid-run: the engine decodes without drafts (same
    tokens), the replica starts a new worker on the same channel, and the engine drafts again."""
    import os
    import signal

    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir)), name="draft-worker-gone", route_prefix=None)
    proposer = RemoteDraftProposer(channel_of(handle), timeout_s=2.0, backoff_s=0.2)
    stats = handle.options(method_name="stats")
    first = stats.remote().result(timeout_s=30)

    assert run_failing_midway(make_engine(target, proposer, k=4), 2, lambda: os.kill(first["pid"], signal.SIGKILL)) \
        == plain
    assert proposer.num_fallback_steps > 0
    deadline = time.monotonic() + 60
    while (now := _stats_or_none(stats)) is None or now["pid"] == first["pid"]:
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.2)
    assert now["restarts"] == 1
    handle.options(method_name="check_health").remote().result(timeout_s=30)  # healthy again
    time.sleep(0.5)  # past the proposer's back-off
    before = proposer.num_proposals
    assert run(make_engine(target, proposer, k=4), PROMPTS, PARAMS) == plain
    assert proposer.num_proposals > before
    serve.delete("draft-worker-gone")


def _stats_or_none(stats) -> dict | None:
    try:
        return stats.remote().result(timeout_s=30)
    except Exception:  # the worker is restarting
        return None


def test_the_app_with_a_draft_deployment_answers_with_the_targets_tokens(ray_cluster, tmp_path):
    """`speculative.placement: deployment` through the whole app over HTTP: the engine replica asks
    the draft deployment for its worker's channel without blocking its event loop (Serve runs the
    constructor and the handle's router there), drafts on it, and answers the target's greedy text."""
    import httpx

    from bench.tiny_checkpoint import MODEL_NAME, save_tiny_checkpoint
    from deployments.app import APP_NAME, build_app
    from moeserve import LLM
    from moeserve.config import AppConfig

    folder = str(save_tiny_checkpoint(tmp_path))  # its own draft: every draft is accepted
    one = {"num_replicas": 1, "num_cpus": 0.5, "max_ongoing_requests": 16}
    config = {"model": {"path": folder, "name": MODEL_NAME}, "engine": {"max_num_seqs": 4, "max_model_len": 256},
              "speculative": {"draft": "model", "draft_path": folder, "num_tokens": 3, "placement": "deployment"},
              "gateway": {"grpc_port": 0}, "deployments": {"gateway": one, "engine": one, "draft": one}}
    serve.run(build_app(config), name=APP_NAME, route_prefix="/app")
    try:
        body = {"model": MODEL_NAME, "prompt": "the bread and the butter", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{ray_cluster}/app/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        stats = serve.get_deployment_handle("engine", APP_NAME).stats.remote().result(timeout_s=60)
        assert stats["draft"]["calls"] > 0 and stats["draft"]["fallback_steps"] == 0, stats["draft"]
    finally:
        serve.delete(APP_NAME)
    expected = LLM(config=AppConfig.from_dict({**config, "speculative": {"draft": "none"}})).generate(
        [body["prompt"]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].text
    assert r.json()["choices"][0]["text"] == expected
