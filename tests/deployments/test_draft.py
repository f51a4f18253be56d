"""The draft deployment: same greedy tokens as the target alone through Serve, sticky or not,
and the engine carries on without drafts when the deployment is slow or gone."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from bench.serve_app import local_ray  # noqa: E402
from deployments.draft import RemoteDraftProposer, bind_draft  # noqa: E402
from deployments.draft_worker import DraftCall, DraftServerConfig, DraftWorker  # noqa: E402
from model_shards import load_checkpoint  # noqa: E402
from moeserve.config import GrammarSection  # noqa: E402
from moeserve.engine.draft_model import DraftModelProposer  # noqa: E402
from moeserve.sampling_params import SamplingParams  # noqa: E402
from moeserve.spec import ProposalRequest  # noqa: E402
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
    with local_ray():
        yield


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


def test_channel_round_trip_secret_and_timeout():
    from multiprocessing import AuthenticationError

    from deployments.draft_channel import ChannelClient, ChannelServer

    after = []
    server = ChannelServer(lambda msg: ("echo", msg) if msg != "slow" else time.sleep(0.5),
                           after=lambda msg, reply, peek, push: after.append(msg), host="127.0.0.1")
    client = ChannelClient(server.address, server.authkey)
    assert client.call([1, 2, 3], timeout_s=5) == ("echo", [1, 2, 3])
    assert client.call({"k": "v"}, timeout_s=5) == ("echo", {"k": "v"})
    assert after == [[1, 2, 3], {"k": "v"}]  # the after-hook runs once the reply is sent
    with pytest.raises(AuthenticationError):
        ChannelClient(server.address, b"not the secret")
    with pytest.raises(TimeoutError):
        client.call("slow", timeout_s=0.05)
    client.close()
    again = ChannelClient(server.address, server.authkey)  # the server still accepts engines
    assert again.call("x", timeout_s=5) == ("echo", "x")
    again.close()
    server.close()


def test_channel_pushes_what_the_after_hook_returns_and_does_not_answer_notices():
    """What `after` returns goes to the engine unasked, unless the engine's next message is
    waiting already (that one is answered instead); a notice is handled but not answered."""
    from deployments.draft_channel import ChannelClient, ChannelServer

    handled = []

    def after(msg, reply, peek, push):
        deadline = time.monotonic() + 5
        while msg == "wait for the next" and peek() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        push(("ahead of", msg))

    def pushes(n):
        deadline, got = time.monotonic() + 5, []
        while len(got) < n and time.monotonic() < deadline:
            got += client.pushed()
        return got

    server = ChannelServer(lambda msg: handled.append(msg) or ("echo", msg), after=after, host="127.0.0.1")
    client = ChannelClient(server.address, server.authkey)
    assert client.call(1, timeout_s=5) == ("echo", 1)
    assert client._conn.poll(5)  # the push of 1 is here before the next call goes out
    assert client.call(2, timeout_s=5) == ("echo", 2)  # ... and is kept, not taken for the reply
    assert pushes(2) == [("ahead of", 1), ("ahead of", 2)]
    client.notify(3)  # no reply; its push follows
    assert pushes(1) == [("ahead of", 3)] and handled == [1, 2, 3]
    client.notify("wait for the next")
    assert client.call(4, timeout_s=5) == ("echo", 4)  # was waiting when `after` returned: no push for the notice
    assert pushes(1) == [("ahead of", 4)] and client.pushed() == []
    client.close()
    server.close()


def test_steps_whose_proposals_were_pushed_do_not_wait_for_a_reply(ckpts):
    """After a call the worker drafts ahead for the likely outcome (every draft accepted, the
    draft's own next token as the bonus) and one round further (that proposal accepted whole
    too), and pushes both. Steps whose histories are those take their proposals from the pushes
    and send notices, which the worker handles like calls (the same proposals, from its
    pre-drafts) without answering. A history no push guessed is a call. Tokens: a fresh draft's,
    always."""
    _, draft_dir, _ = ckpts
    worker = DraftWorker(config(draft_dir))
    address, key = worker.channel()
    proposer = RemoteDraftProposer(channel_source=lambda timeout_s: (address, key), timeout_s=30.0)
    fresh = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)

    def drafted(history):
        return fresh.propose([ProposalRequest("f", history, 3)])[0].token_ids

    def wait_for(what):
        deadline = time.monotonic() + 30
        while not what():
            assert time.monotonic() < deadline
            proposer._drain()
            time.sleep(0.005)

    first = proposer.propose([ProposalRequest("s0", PROMPTS[0], 3)])[0].token_ids
    h1 = PROMPTS[0] + first + drafted(PROMPTS[0] + first)[:1]
    h2 = h1 + drafted(h1) + drafted(h1 + drafted(h1))[:1]
    wait_for(lambda: len(proposer._pushed.get("s0", [])) == 2)  # the next round and the one after
    got = proposer.propose([ProposalRequest("s0", h1, 3)])[0]
    assert got.predrafted and got.token_ids == drafted(h1) and proposer.num_pushed_steps == 1
    got = proposer.propose([ProposalRequest("s0", h2, 3)])[0]
    assert got.predrafted and got.token_ids == drafted(h2) and proposer.num_pushed_steps == 2
    wait_for(lambda: worker.stats()["calls"] == 3)  # one call, two notices: each handled from a pre-draft
    assert worker.stats()["predraft_hits"] == 2 and proposer.num_calls == 3
    wrong = h2 + [(got.token_ids[0] + 1) % 90]
    again = proposer.propose([ProposalRequest("s0", wrong, 3)])[0]
    assert again.token_ids == drafted(wrong) and not again.predrafted
    assert proposer.num_pushed_steps == 2 and worker.stats()["calls"] == 4


def test_one_round_of_predrafting_pushes_the_next_proposal_only(ckpts):
    _, draft_dir, _ = ckpts
    worker = DraftWorker(replace(config(draft_dir), predraft_rounds=1))
    address, key = worker.channel()
    proposer = RemoteDraftProposer(channel_source=lambda timeout_s: (address, key), timeout_s=30.0)
    proposer.propose([ProposalRequest("s0", PROMPTS[0], 3)])
    deadline = time.monotonic() + 30
    while not proposer._pushed.get("s0"):
        assert time.monotonic() < deadline
        proposer._drain()
        time.sleep(0.005)
    time.sleep(0.1)
    proposer._drain()
    assert len(proposer._pushed["s0"]) == 1 and worker.stats()["predrafts"] == 1
    with pytest.raises(ValueError, match="predraft_rounds"):
        replace(config(draft_dir), predraft_rounds=3)


def test_draft_process_pins_answers_and_comes_back_after_a_kill(ckpts):
    """The worker in its own process: proposes what the in-process proposer does over its
    channel, runs on the CPUs it was given, and a new process (new channel) replaces a killed one."""
    import os

    from deployments.draft_channel import ChannelClient
    from deployments.draft_process import DraftProcess

    _, draft_dir, _ = ckpts
    cpu = max(os.sched_getaffinity(0))
    proc = DraftProcess(replace(config(draft_dir), cpus=(cpu,)))
    try:
        local = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)
        reqs = [ProposalRequest(f"s{i}", p, 4) for i, p in enumerate(PROMPTS)]
        client = ChannelClient(*proc.channel(5.0))
        assert [p.token_ids for p in client.call(DraftCall(reqs), 30)] == [p.token_ids for p in local.propose(reqs)]
        first = proc.stats()
        assert first["cpus"] == [cpu] and first["calls"] == 1 and first["restarts"] == 0
        proc.check()
        proc.kill()
        with pytest.raises((EOFError, OSError)):
            client.call(DraftCall(reqs), 30)
        deadline = time.monotonic() + 60
        while proc.restarts == 0:
            assert time.monotonic() < deadline, "the worker process was not restarted"
            time.sleep(0.05)
        address, key = proc.channel(5.0)
        assert proc.pid != first["pid"] and proc.stats()["calls"] == 0
        proc.check()
        again = ChannelClient(address, key)
        assert [p.token_ids for p in again.call(DraftCall(reqs), 30)] == [p.token_ids for p in local.propose(reqs)]
        again.close()
    finally:
        proc.close()


def test_a_draft_process_that_cannot_start_says_why(tmp_path):
    from deployments.draft_process import DraftProcess

    with pytest.raises(RuntimeError, match="did not start"):
        DraftProcess(config(str(tmp_path / "no-such-checkpoint")), start_timeout_s=60)


def test_predrafted_proposals_are_what_drafting_then_would_give(ckpts):
    """Hits (the next call brings a history pre-drafted for: every draft accepted with the draft's
    own next token as the bonus, or the first draft rejected with the draft's second choice as
    the correction) answer with the tokens a fresh draft gives for that history; a miss drafts
    anew: the same tokens either way."""
    _, draft_dir, _ = ckpts
    worker = DraftWorker(replace(config(draft_dir), predraft_partial=3))
    fresh = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)
    reqs = [ProposalRequest(f"s{i}", p, 3) for i, p in enumerate(PROMPTS[:3])]
    call = DraftCall(reqs)
    first = worker.propose(call)
    second_choice = {seq: [alt for _, alt, _ in seconds] for seq, seconds in worker.proposer.runner_up.items()}
    worker.predraft(call, first)
    guess = fresh.propose([ProposalRequest("g", reqs[0].token_ids + first[0].token_ids, 1)])[0].token_ids
    wrong = next(t for t in range(2, 90) if t not in (first[2].token_ids[0], second_choice["s2"][0]))
    nxt = [ProposalRequest("s0", reqs[0].token_ids + first[0].token_ids + guess, 3),
           ProposalRequest("s1", reqs[1].token_ids + [second_choice["s1"][0]], 3),
           ProposalRequest("s2", reqs[2].token_ids + [wrong], 3)]
    got = worker.propose(DraftCall(nxt))
    want = [fresh.propose([ProposalRequest(f"f{i}", r.token_ids, 3)])[0].token_ids for i, r in enumerate(nxt)]
    assert [p.token_ids for p in got] == want
    assert worker.num_predraft_hits == 2 and worker.num_predraft_misses == 1
    worker.propose(DraftCall([], finished=["s0", "s1", "s2"]))
    assert worker.stats()["tracked_seqs"] == 0  # the partial outcomes' draft sequences went with them


def test_partial_outcomes_are_predrafted_where_the_draft_was_least_sure(ckpts):
    """predraft_partial=1: one rejection outcome per row, at the draft position whose first
    choice led its second by the least logit gap, with the second choice as the correction."""
    _, draft_dir, _ = ckpts
    worker = DraftWorker(replace(config(draft_dir), predraft_partial=1))
    call = DraftCall([ProposalRequest(f"s{i}", p, 4) for i, p in enumerate(PROMPTS[:2])])
    first = worker.propose(call)
    seconds = dict(worker.proposer.runner_up)
    worker.predraft(call, first)
    for i, p in enumerate(first):
        drafted, alts, gaps = zip(*seconds[f"s{i}"])
        assert list(drafted) == p.token_ids
        j = min(range(len(gaps)), key=gaps.__getitem__)
        assert worker._hypotheses[f"s{i}"] == {f"s{i}#{j}"}
        partial = tuple(PROMPTS[i] + p.token_ids[:j] + [alts[j]])
        assert partial in worker._ahead[f"s{i}"]


def test_predrafting_stops_for_a_call_it_did_not_guess(ckpts):
    """The engine's next call arrives mid-pre-draft with a history no outcome assumed: the
    pre-draft stops at the next draft step, keeps nothing, and drafting that call gives what a
    fresh draft gives (the interrupted writes lie past what the draft's cache holds)."""
    _, draft_dir, _ = ckpts
    worker = DraftWorker(config(draft_dir))
    fresh = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)
    reqs = [ProposalRequest(f"s{i}", p, 4) for i, p in enumerate(PROMPTS[:2])]
    call = DraftCall(reqs)
    first = worker.propose(call)
    surprise = DraftCall([ProposalRequest("s0", reqs[0].token_ids + [(first[0].token_ids[0] + 1) % 90], 4)])
    worker.predraft(call, first, peek=lambda: surprise)
    assert worker.num_predraft_interrupted == 1 and not worker._ahead
    got = worker.propose(surprise)
    assert got[0].token_ids == fresh.propose([ProposalRequest("f", surprise.requests[0].token_ids, 4)])[0].token_ids
    guessed = DraftCall([ProposalRequest("s1", reqs[1].token_ids + first[1].token_ids + [5], 4)])
    worker.predraft(DraftCall(reqs[1:]), first[1:], peek=lambda: guessed)  # a history being drafted: runs on
    assert "s1" in worker._ahead
    # ... and the round further ahead stops for it (it waits): 2 interruptions in all
    assert worker.num_predraft_interrupted == 2 and len(worker._ahead["s1"]) == 1
    worker._queued = 1  # another engine's call waits for the worker: the round further ahead yields to it too
    worker.predraft(DraftCall(reqs[:1]), first[:1])
    assert worker.num_predraft_interrupted == 3 and len(worker._ahead["s0"]) == 1


def test_the_round_further_ahead_runs_on_for_a_notice_that_confirms_it(ckpts):
    """PEARL's post-verify: the round further ahead is the proposal for the engine's step after
    next. A notice saying that the engine took the pushed proposal this round goes on from does
    not stop it (stopping would only draft it again); handling that notice then finds the row's
    next proposal drafted and drafts only the round after it. A notice with another history
    stops it."""
    from deployments.draft_channel import Notice

    _, draft_dir, _ = ckpts
    worker = DraftWorker(config(draft_dir))
    fresh = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)
    call = DraftCall([ProposalRequest("s0", PROMPTS[0], 3)])
    first = worker.propose(call)
    h1 = PROMPTS[0] + first[0].token_ids
    h1 = h1 + fresh.propose([ProposalRequest("g", h1, 1)])[0].token_ids  # the guessed bonus token
    confirm = Notice(DraftCall([ProposalRequest("s0", h1, 3)]))
    worker.predraft(call, first, peek=lambda: confirm)
    assert worker.num_predraft_interrupted == 0 and worker.num_predrafts == 2 and len(worker._ahead["s0"]) == 2
    got = worker.propose(confirm.msg)
    assert got[0].predrafted and got[0].token_ids == fresh.propose([ProposalRequest("f", h1, 3)])[0].token_ids
    worker.predraft(confirm.msg, got)
    assert worker.num_predrafts == 3 and len(worker._ahead["s0"]) == 2  # the rounds after h1's proposal
    call = DraftCall([ProposalRequest("t0", PROMPTS[1], 3)])
    first = worker.propose(call)
    other = Notice(DraftCall([ProposalRequest("t0", PROMPTS[1] + [(first[0].token_ids[0] + 1) % 90], 3)]))
    worker.predraft(call, first, peek=lambda: other)
    assert worker.num_predraft_interrupted == 1 and len(worker._ahead["t0"]) == 1  # the round further ahead


def test_an_ahead_call_drafts_a_new_sequence_while_the_target_prefills(ckpts):
    """An `ahead` call (the engine's prepare, before its prefill) is answered at once with no
    drafts; its pre-draft guesses the target's first token is the draft's own. The first call
    then answers from it on a hit; on a miss, or when the pre-draft was stopped for a call it did
    not guess, the prompt is not prefilled on the draft again. Tokens: a fresh draft's, always."""
    _, draft_dir, _ = ckpts
    worker = DraftWorker(config(draft_dir))
    fresh = DraftModelProposer(load_checkpoint(draft_dir), 8, 96)
    reqs = [ProposalRequest(f"s{i}", p, 3) for i, p in enumerate(PROMPTS[:3])]
    ahead = DraftCall(reqs, ahead=True)
    answered = worker.propose(ahead)
    assert [p.token_ids for p in answered] == [[], [], []] and worker.stats()["prepares"] == 1
    first = [fresh.propose([ProposalRequest(f"g{i}", r.token_ids, 1)])[0].token_ids[0] for i, r in enumerate(reqs)]
    surprise = DraftCall([ProposalRequest("s2", reqs[2].token_ids + [(first[2] + 1) % 90, 5], 3)])
    worker.predraft(DraftCall(reqs[2:], ahead=True), answered[2:], peek=lambda: surprise)
    assert worker.num_predraft_interrupted == 1
    assert worker.proposer._seqs["s2"].cached == list(reqs[2].token_ids)  # the prompt's prefill was kept
    worker.predraft(DraftCall(reqs[:2], ahead=True), answered[:2])
    new_seqs = worker.stats()["new_seqs"]
    assert new_seqs == 3
    nxt = [ProposalRequest("s0", reqs[0].token_ids + [first[0]], 3),
           ProposalRequest("s1", reqs[1].token_ids + [(first[1] + 1) % 90], 3)] + surprise.requests
    got = worker.propose(DraftCall(nxt))
    want = [fresh.propose([ProposalRequest(f"f{i}", r.token_ids, 3)])[0].token_ids for i, r in enumerate(nxt)]
    assert [p.token_ids for p in got] == want
    assert [p.predrafted for p in got] == [True, False, False]
    stats = worker.stats()
    assert (stats["predraft_hits"], stats["predraft_misses"], stats["new_seqs"]) == (1, 1, new_seqs)


def test_predrafts_still_answer_after_plain_steps_went_on_from_them():
    """Between two calls the engine may decode plain steps (adaptive k's measuring steps): when
    what they emitted is the start of a pre-draft, the rest of it still answers."""
    from deployments.draft_worker import _continuing

    ahead = {(1, 2, 3): [4, 5, 6, 7]}
    assert _continuing(ahead, (1, 2, 3)) == [4, 5, 6, 7]
    assert _continuing(ahead, (1, 2, 3, 4, 5)) == [6, 7]
    assert _continuing(ahead, (1, 2, 3, 4, 9)) == []  # a plain step emitted what the draft did not guess
    assert _continuing(ahead, (1, 2, 3, 4, 5, 6, 7)) == []  # nothing drafted is left
    assert _continuing(ahead, (1, 2, 8)) == []


class _Response:
    def __init__(self, outcome):
        self.outcome = outcome

    def result(self, timeout_s=None):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


class _FakeHandle:
    """Answers each call with the next outcome: a list of proposals or an exception."""

    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def options(self, **_):
        return self

    def remote(self, call):
        self.calls.append(call)
        return _Response(self.outcomes.pop(0))


def test_remote_proposer_falls_back_backs_off_and_recovers():
    from moeserve.spec import Proposal

    handle = _FakeHandle([TimeoutError(), RuntimeError("deployment gone"), [Proposal([7, 8])]])
    proposer = RemoteDraftProposer(handle, timeout_s=0.1, backoff_s=0.05, max_backoff_s=1.0, direct=False)
    req = [ProposalRequest("a", [1, 2, 3], 2), ProposalRequest("b", [4], 0)]
    assert [p.token_ids for p in proposer.propose(req)] == [[], []]  # timed out
    assert [p.token_ids for p in proposer.propose(req)] == [[], []]  # backing off: no call
    assert len(handle.calls) == 1
    proposer.on_finished("gone")
    time.sleep(0.06)
    assert [p.token_ids for p in proposer.propose(req)] == [[], []]  # error, pause doubles to 0.1 s
    time.sleep(0.11)
    assert [p.token_ids for p in proposer.propose(req)] == [[7, 8], []]
    assert len(handle.calls) == 3
    assert [r.num_tokens for r in handle.calls[-1].requests] == [2]  # rows asking for nothing are not sent
    assert handle.calls[-1].finished == [f"{proposer.session}/gone"]  # resent after the failed call
    stats = proposer.stats()
    assert stats.pop("wait_s") >= 0 and stats.pop("wait_s_per_call") >= 0
    assert stats == {"calls": 3, "prepares": 0, "proposals": 1, "predraft_hits": 0, "predraft_hit_rate": 0.0,
                     "fallback_steps": 3, "pushed_steps": 0, "timeouts": 1, "errors": 1}
    proposer.prepare(req)  # a Serve call per prefill would cost more than it saves: none is made
    assert len(handle.calls) == 3 and proposer.num_prepares == 0


def test_prepare_names_new_sequences_over_the_channel_without_counting_a_step():
    from deployments.draft_channel import ChannelServer
    from moeserve.spec import Proposal

    seen = []

    def handle(call):
        seen.append(call)
        return [Proposal([]) if call.ahead else Proposal([5]) for _ in call.requests]

    server = ChannelServer(handle, host="127.0.0.1")
    proposer = RemoteDraftProposer(channel_source=lambda timeout_s: (server.address, server.authkey), timeout_s=5.0)
    proposer.on_finished("old")
    proposer.prepare([ProposalRequest("a", [1, 2, 3], 4), ProposalRequest("b", [4], 0)])
    assert [p.token_ids for p in proposer.propose([ProposalRequest("a", [1, 2, 3, 7], 4)])] == [[5]]
    ahead, step = seen
    assert ahead.ahead and not step.ahead
    assert [(r.seq_id, list(r.token_ids), r.num_tokens) for r in ahead.requests] == [(f"{proposer.session}/a", [1, 2, 3], 4)]
    assert ahead.finished == [f"{proposer.session}/old"] and step.finished == []
    stats = proposer.stats()
    assert (stats["calls"], stats["prepares"], stats["proposals"], stats["fallback_steps"]) == (1, 1, 1, 0)
    server.close()


def test_the_draft_deployments_counters_reach_metrics(ckpts):
    """The engine core reports its proposer's counters (pre-draft hits, time waited for drafts,
    fallbacks), and /metrics shows them as moeserve_engine{name="draft_..."}."""
    from deployments.metrics import GatewayMetrics
    from moeserve.engine.core import EngineCore
    from moeserve.spec import Proposal

    target, _, _ = ckpts
    handle = _FakeHandle([[Proposal([7, 8], predrafted=True), Proposal([9])]])
    proposer = RemoteDraftProposer(handle, timeout_s=1.0, direct=False)
    proposer.propose([ProposalRequest("a", [1, 2], 2), ProposalRequest("b", [3], 1)])
    stats = EngineCore(make_engine(target, proposer, k=2)).stats()["draft"]
    assert (stats["calls"], stats["proposals"], stats["predraft_hits"], stats["predraft_hit_rate"]) == (1, 2, 1, 0.5)
    text = GatewayMetrics().render({"draft": stats}).decode()
    assert 'moeserve_engine{name="draft_predraft_hit_rate"} 0.5' in text
    assert 'moeserve_engine{name="draft_wait_s_per_call"}' in text


# ---- through Serve -----------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False], ids=["channel", "serve-call"])
def test_served_draft_gives_the_target_greedy_tokens(ray_cluster, ckpts, direct):
    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir)), name="draft-one", route_prefix=None)
    proposer = RemoteDraftProposer(handle, timeout_s=30.0, direct=direct)
    engine = make_engine(target, proposer, k=4)
    assert run(engine, PROMPTS, PARAMS) == plain
    assert proposer.num_fallback_steps == 0 and proposer.num_calls == engine.spec_metrics.num_steps
    assert engine.spec_metrics.alpha > 0.2
    stats = handle.options(method_name="stats", session_id=proposer.session).remote().result(timeout_s=30)
    assert stats["calls"] == proposer.num_calls  # every call reached the one replica's worker
    if direct:  # every step over the worker's data channel: one connection
        assert stats["channel_connections"] == 1
        assert stats["predrafts"] > 0  # run (finished, or stopped for a call it had not guessed)
    serve.delete("draft-one")


def test_a_draft_that_is_always_right_is_answered_from_its_predrafts(ray_cluster, ckpts, tmp_path):
    """The target as its own draft: every draft is accepted and the bonus token is the draft's
    own next one, so every call finds its proposal drafted already: while the target verified
    the previous one, or for a request's first call, while the target prefilled it."""
    target, _, plain = ckpts
    save_tiny("mixtral", tmp_path)  # the same weights as the target
    handle = serve.run(bind_draft(config(str(tmp_path))), name="draft-same", route_prefix=None)
    proposer = RemoteDraftProposer(handle, timeout_s=30.0)
    engine = make_engine(target, proposer, k=2)
    assert run(engine, PROMPTS, PARAMS) == plain
    assert engine.spec_metrics.alpha == 1.0
    ask = handle.options(method_name="stats", session_id=proposer.session)
    deadline = time.monotonic() + 30
    while True:  # notices are not answered: the worker may still be handling the last ones
        stats = ask.remote().result(timeout_s=30)
        if (stats["calls"], stats["prepares"]) == (proposer.num_calls, proposer.num_prepares) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["prepares"] == proposer.num_prepares >= 1  # a call per prefill step
    assert stats["predraft_hits"] == proposer.num_proposals, (stats, proposer.stats())  # every row, first calls too
    # the engine's side counts the same hits, for /metrics (moeserve_engine{name="draft_predraft_hit_rate"})
    mine = proposer.stats()
    assert mine["predraft_hits"] == stats["predraft_hits"] and mine["proposals"] >= proposer.num_calls
    assert mine["predraft_hit_rate"] == mine["predraft_hits"] / mine["proposals"] > 0
    serve.delete("draft-same")


def test_two_replicas_sticky_or_not(ray_cluster, ckpts):
    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir), num_replicas=2), name="draft-two", route_prefix=None)
    sticky = RemoteDraftProposer(handle, timeout_s=30.0)
    assert run(make_engine(target, sticky, k=4), PROMPTS, PARAMS) == plain
    stats = handle.options(method_name="stats", session_id=sticky.session).remote().result(timeout_s=30)
    assert stats["calls"] == sticky.num_calls and stats["rebuilt_tokens"] == 0  # every call on one replica
    loose = RemoteDraftProposer(handle, timeout_s=30.0, sticky=False)  # replicas alternate: rebuilds
    assert run(make_engine(target, loose, k=4), PROMPTS, PARAMS) == plain
    serve.delete("draft-two")


def test_slow_draft_times_out_and_the_request_completes(ray_cluster, ckpts):
    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir)), name="draft-slow", route_prefix=None)
    proposer = RemoteDraftProposer(handle, timeout_s=1e-4, backoff_s=0.0, max_backoff_s=0.0)
    engine = make_engine(target, proposer, k=4)
    assert run(engine, PROMPTS, PARAMS) == plain
    # every step whose call timed out decoded without drafts (a prepare call may time out too: no step waited on it)
    assert proposer.num_timeouts > 0 and proposer.num_fallback_steps >= proposer.num_timeouts - proposer.num_prepares
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
    proposer = RemoteDraftProposer(handle, timeout_s=2.0, backoff_s=0.2)
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
    tokens), the replica starts a new worker, and the engine drafts again on its new channel."""
    import os
    import signal

    target, draft_dir, plain = ckpts
    handle = serve.run(bind_draft(config(draft_dir)), name="draft-worker-gone", route_prefix=None)
    proposer = RemoteDraftProposer(handle, timeout_s=2.0, backoff_s=0.2)
    stats = handle.options(method_name="stats", session_id=proposer.session)
    first = stats.remote().result(timeout_s=30)

    assert run_failing_midway(make_engine(target, proposer, k=4), 2, lambda: os.kill(first["pid"], signal.SIGKILL)) \
        == plain
    assert proposer.num_errors > 0 and proposer.num_fallback_steps > 0
    deadline = time.monotonic() + 60
    while (now := _stats_or_none(stats))  is None or now["pid"] == first["pid"]:
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.2)
    assert now["restarts"] == 1
    handle.options(method_name="check_health").remote().result(timeout_s=30)  # healthy again
    time.sleep(0.5)  # past the proposer's back-off
    again = RemoteDraftProposer(handle, timeout_s=30.0)
    assert run(make_engine(target, again, k=4), PROMPTS, PARAMS) == plain
    assert again.num_fallback_steps == 0 and again.num_proposals > 0
    serve.delete("draft-worker-gone")


def _stats_or_none(stats) -> dict | None:
    try:
        return stats.remote().result(timeout_s=30)
    except Exception:  # the worker is restarting
        return None


def test_a_draft_worker_drafts_constrained_rows_under_its_own_grammar(tmp_path):
    """Constrained rows through a draft worker (its channel, no Ray): each call carries the row's
    grammar spec and how far its output has gone, and the worker drafts under a matcher of its own
    (compiled in the background), so, with the target as its own draft, nearly every draft is
    accepted, as with the draft in the engine's process shown the grammar. Greedy output is plain
    decoding's and every output satisfies its grammar."""
    from bench.tiny_checkpoint import save_tiny_checkpoint
    from deployments.draft_process import DraftProcess
    from moeserve.tokenizer import load_tokenizer
    from tests.engine.test_structured_output import PROMPTS as TEXTS
    from tests.engine.test_structured_output import SPECS, NoGrammarDraft, assert_accepted
    from tests.engine.test_structured_output import make_engine as structured_engine
    from tests.engine.test_structured_output import run as run_jobs

    folder = save_tiny_checkpoint(tmp_path)
    tokenizer = load_tokenizer(folder)
    from moeserve.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer), config=GrammarSection().grammar_config())
    jobs = [(p, SamplingParams(max_tokens=60, temperature=0.0), compiler.compile(s))
            for p in TEXTS[:2] for s in (SPECS["json_schema"], SPECS["regex"], SPECS["ebnf"])]
    plain = run_jobs(structured_engine(folder, tokenizer), jobs)
    worker = DraftProcess(DraftServerConfig(str(folder), max_num_seqs=16, max_model_len=512, torch_threads=1))
    per_pass = {}
    try:
        for shown in (True, False):
            remote = RemoteDraftProposer(channel_source=worker.channel, timeout_s=30)
            engine = structured_engine(folder, tokenizer, remote if shown else NoGrammarDraft(remote), k=4)
            run_jobs(engine, jobs)  # the worker compiles each spec on its first sight of it, meanwhile unconstrained
            engine.spec_metrics = type(engine.spec_metrics)()
            got = run_jobs(engine, jobs)
            assert [t for t, _, _ in got] == [t for t, _, _ in plain]
            for spec, (tokens, text, reason) in zip([j[2].spec for j in jobs], got):
                assert_accepted(spec, compiler, tokens, text, reason)
            per_pass[shown] = engine.spec_metrics.tokens_per_pass
        assert per_pass[True] > per_pass[False] + 0.5, per_pass  # not shown: drafts the grammar refuses are cut
        stats = worker.stats()
        assert stats["grammars_compiled"] == 3 and stats["grammars_failed"] == 0
    finally:
        worker.close()


def test_a_grammar_mirror_follows_each_sequences_output(tmp_path):
    """The worker's matcher for a sequence: none while its spec compiles (in the background), then
    standing after the output the call names; advanced by new output, made afresh for a history
    that does not extend it, dropped where it refuses what the engine's grammar took."""
    from bench.tiny_checkpoint import save_tiny_checkpoint
    from deployments.draft_grammar import GrammarMirror, RemoteGrammar
    from moeserve.grammar import GrammarCompiler, GrammarMatcher, GrammarSpec
    from moeserve.tokenizer import load_tokenizer

    folder = save_tiny_checkpoint(tmp_path)
    tokenizer = load_tokenizer(folder)
    spec = GrammarSpec.regex(r"ab+c")
    engine_side = GrammarMatcher(GrammarCompiler(tokenizer, len(tokenizer), config=GrammarSection().grammar_config()).compile(spec))
    output = tokenizer.encode("abbb", add_special_tokens=False)
    assert engine_side.accept_tokens(output) == len(output)
    mirror = GrammarMirror(str(folder), len(tokenizer))
    prompt = [5, 6, 7]
    g = RemoteGrammar(spec, len(output))
    deadline = time.monotonic() + 60
    while (m := mirror.matcher("s", g, prompt + output)) is None:  # compiling
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert m.num_accepted == len(output) and mirror.held("s") is m
    more = tokenizer.encode("b", add_special_tokens=False)
    assert mirror.matcher("s", RemoteGrammar(spec, len(output) + len(more)), prompt + output + more) is m
    assert m.num_accepted == len(output) + len(more)  # advanced, not rebuilt
    other = tokenizer.encode("ab", add_special_tokens=False)
    fresh = mirror.matcher("s", RemoteGrammar(spec, len(other)), prompt + other)  # not an extension: afresh
    assert fresh is not m and fresh.num_accepted == len(other)
    bad = tokenizer.encode("x", add_special_tokens=False)
    assert mirror.matcher("s", RemoteGrammar(spec, len(other) + len(bad)), prompt + other + bad) is None
    assert mirror.held("s") is None and mirror.num_compiled == 1
    mirror.matcher("t", g, prompt + output)
    mirror.forget("t")
    assert mirror.num_held == 0
