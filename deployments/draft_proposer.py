"""The engine's side of the draft deployment: `RemoteDraftProposer`, one message per engine
step to the draft worker (deployments/draft.py has the deployment). No Ray here: the handle
is only used through its methods, and an engine core in a process of its own reaches the
channel through its replica (`ChannelLookup`), so that process never loads Ray.
"""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from deployments.draft_channel import ChannelClient
from deployments.draft_grammar import RemoteGrammar
from deployments.draft_worker import DraftCall, Predraft
from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer

log = logging.getLogger(__name__)

START_CONNECT_TIMEOUT_S = 60.0  # the draft deployment may still be starting beside the engine


class RemoteDraftProposer(Proposer):
    """Engine-side proposer: one message to the draft deployment per engine step, a call, or,
    when the worker pushed the step's proposals already, a notice that is not waited on.

    handle: a DeploymentHandle to DraftServer; or, without one,
    channel_source: a function that gives the data channel's address and secret within a
        timeout (an engine core in a process of its own asks its replica: `ChannelLookup`).
    timeout_s: how long a step waits for drafts (or for the deployment to name its worker)
        before decoding without them.
    backoff_s, max_backoff_s: after a failure no call is made for backoff_s, doubling with
        each further failure up to max_backoff_s; a success resets it.
    sticky: route every Serve call of this engine to one replica (its session id).
    direct: talk to the replica's DraftWorker over its data channel (default: one socket message
        each way per step, its address asked of the deployment once), not through a Serve call
        per step.
    """

    cost_per_call = True  # a round trip per step; the worker drafts while the target verifies

    def __init__(
        self,
        handle: Any = None,
        timeout_s: float = 0.5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        sticky: bool = True,
        direct: bool = True,
        channel_source: Callable[[float], tuple[tuple[str, int], bytes]] | None = None,
    ) -> None:
        if timeout_s <= 0 or backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError("need timeout_s > 0 and 0 <= backoff_s <= max_backoff_s")
        if (handle is None) == (channel_source is None):
            raise ValueError("give a handle to the draft deployment or a channel_source, not both")
        self.session = uuid.uuid4().hex[:12]
        self.handle = None
        if handle is not None:
            routing = {"session_id": self.session} if sticky else {}
            self.handle = handle.options(method_name="propose", **routing)
            if direct:
                channel = handle.options(method_name="channel", **routing)
                channel_source = lambda timeout_s: channel.remote().result(timeout_s=timeout_s)  # noqa: E731
        self._channel_source = channel_source  # None: a Serve call per step
        self._client: Any = None  # the data channel to the replica's worker
        self.draft_wait_s = 0.0  # time steps spent waiting for drafts
        self.timeout_s, self.backoff_s, self.max_backoff_s = timeout_s, backoff_s, max_backoff_s
        self._pause_s = backoff_s
        self._retry_at = 0.0
        self._finished: deque[str] = deque(maxlen=100_000)  # the server's LRU covers any overflow
        self.num_calls = 0  # propose calls made (prepare calls are counted apart)
        self.num_prepares = 0  # prepare calls made (sequences named before their prefill)
        self.num_proposals = 0  # rows answered with drafts
        self.num_predraft_hits = 0  # of them, drafted ahead while the target verified or prefilled (Proposal.predrafted)
        self.num_fallback_steps = 0  # steps decoded without drafts because of the deployment
        self.num_pushed_steps = 0  # steps whose drafts the worker had pushed already: no wait for a reply
        self.num_timeouts = 0
        self.num_errors = 0
        self._pushed: dict[str, list[Predraft]] = {}  # seq id -> the worker's pre-drafts for it, pushed

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Drafts for the batch, or none at all (fallback) when the deployment is slow or gone."""
        empty = [Proposal([]) for _ in requests]
        asked = [r for r in requests if r.num_tokens > 0]
        if not asked:
            return empty
        if time.monotonic() < self._retry_at:
            self.num_fallback_steps += 1
            return empty
        self.num_calls += 1
        t0 = time.perf_counter()
        got = self._send(asked, pushed=self._from_pushes(asked))
        self.draft_wait_s += time.perf_counter() - t0
        if got is None:
            self.num_fallback_steps += 1
            return empty
        self.num_proposals += sum(1 for p in got if p.token_ids)
        self.num_predraft_hits += sum(1 for p in got if p.predrafted)
        by_id = dict(zip((r.seq_id for r in asked), got))
        return [by_id.get(r.seq_id, p) for r, p in zip(requests, empty)]

    def prepare(self, requests: list[ProposalRequest]) -> None:
        """Names the sequences about to be prefilled to the worker (a notice: nothing to wait
        for), which drafts their first proposals while the target prefills (guessing that the
        target's first token is the draft's own) and pushes them. Over the data channel only: a
        Serve call costs more than a prefill saves."""
        asked = [r for r in requests if r.num_tokens > 0]
        if asked and self._channel_source is not None and time.monotonic() >= self._retry_at:
            self.num_prepares += 1
            self._send(asked, ahead=True, pushed=[])

    def _from_pushes(self, asked: list[ProposalRequest]) -> list[Proposal] | None:
        """Every row's proposal from what the worker pushed (drafted ahead for the history the row
        has now), or None when a row has none there: then the step calls."""
        if not self._drain():
            return None
        out = []
        for r in asked:
            tokens = next((t for p in self._pushed.get(r.seq_id, ()) if (t := p.after(r.token_ids))), None)
            if tokens is None:
                return None
            out.append(Proposal(tokens[: r.num_tokens], predrafted=True))
        return out

    def _drain(self) -> bool:
        """Takes in what the worker pushed since the last step; whether the channel is open."""
        if self._client is None:
            return False
        try:
            pushes = self._client.pushed()
        except (EOFError, OSError):  # the worker is gone: the call finds out and falls back
            return False
        prefix = self.session + "/"
        for push in pushes:
            for seq, predrafts in push.items():
                self._pushed.setdefault(seq.removeprefix(prefix), []).extend(predrafts)
        return True

    def _send(self, asked: list[ProposalRequest], ahead: bool = False,
              pushed: list[Proposal] | None = None) -> list[Proposal] | None:
        """One call to the worker with the sequences finished since the last; None when it
        failed (then no call is made for a while). pushed: the rows' proposals came pushed; the
        call goes as a notice (the worker answers the same from its pre-drafts, unasked, and
        drafts on) and they are returned without waiting."""
        finished = list(self._finished)
        self._finished.clear()
        prefix = self.session + "/"
        grammars = {prefix + r.seq_id: g for r in asked if (g := RemoteGrammar.of(r)) is not None}
        call = DraftCall(
            [ProposalRequest(prefix + r.seq_id, r.token_ids, r.num_tokens, r.params) for r in asked],
            [prefix + s for s in finished],
            ahead,
            grammars,
        )
        for r in asked:  # keep the pre-drafts for longer histories (drafted a round further ahead)
            later = [p for p in self._pushed.pop(r.seq_id, ()) if p.base + len(p.suffix) > len(r.token_ids)]
            if later:
                self._pushed[r.seq_id] = later
        try:
            if pushed is not None:
                self._over_channel(call, notice=True)
                self.num_pushed_steps += not ahead
                return pushed
            got = self._call(call)
        except TimeoutError:
            self.num_timeouts += 1
            self._fail(finished, "timed out")
            return None
        except Exception as e:  # deployment deleted, replica died, serialization...: never fail the step
            self.num_errors += 1
            self._fail(finished, f"{type(e).__name__}: {e}")
            return None
        self._pause_s = self.backoff_s
        return got

    def _call(self, call: DraftCall) -> list[Proposal]:
        if self._channel_source is None:
            return self.handle.remote(call).result(timeout_s=self.timeout_s)
        return self._over_channel(call)

    def connect(self, timeout_s: float) -> bool:
        """Open the data channel now (at start-up, so that no engine step pays for the lookup);
        whether it is open. Otherwise it opens on the first call, and again after a failure."""
        try:
            if self._client is None and self._channel_source is not None:
                self._client = ChannelClient(*self._channel_source(timeout_s))
        except Exception as e:
            log.warning("draft channel not open yet (%s: %s); trying again on the first step", type(e).__name__, e)
        return self._client is not None

    def _over_channel(self, call: DraftCall, notice: bool = False) -> list[Proposal] | None:
        """The worker's data channel, its address asked for (one Serve call) on first use and
        after a failure. notice: sent as a notice, not answered (None)."""
        if self._client is None:
            self._client = ChannelClient(*self._channel_source(self.timeout_s))
        try:
            if notice:
                return self._client.notify(call)
            return self._client.call(call, self.timeout_s)
        except Exception:  # timed out (a late reply would answer the next call) or the worker died
            self._client.close()
            self._client = None
            self._pushed.clear()  # a new worker drafted none of them
            raise

    def on_finished(self, seq_id: str) -> None:
        """Queued; sent with the next call (no Serve call of its own)."""
        self._finished.append(seq_id)
        self._pushed.pop(seq_id, None)

    def stats(self) -> dict[str, float]:
        """Counters for /metrics (`moeserve_engine{name="draft_..."}`): calls, rows answered from a
        pre-draft and their share, steps answered from a push (no wait for a reply), steps decoded
        without drafts, and time steps waited for drafts."""
        return {
            "calls": self.num_calls,
            "prepares": self.num_prepares,
            "proposals": self.num_proposals,
            "predraft_hits": self.num_predraft_hits,
            "predraft_hit_rate": self.num_predraft_hits / max(self.num_proposals, 1),
            "fallback_steps": self.num_fallback_steps,
            "pushed_steps": self.num_pushed_steps,
            "timeouts": self.num_timeouts,
            "errors": self.num_errors,
            "wait_s": self.draft_wait_s,
            "wait_s_per_call": self.draft_wait_s / max(self.num_calls, 1),
        }

    def _fail(self, finished: list[str], why: str) -> None:
        # The call may not have arrived: send its finished ids again next time (freeing twice is harmless).
        self._finished.extendleft(reversed(finished))
        self._retry_at = time.monotonic() + self._pause_s
        log.warning("draft deployment %s; decoding without drafts for %.1f s", why, self._pause_s)
        self._pause_s = min(self._pause_s * 2, self.max_backoff_s)


class ChannelLookup:
    """`channel_source` for an engine core in a process of its own: asks its replica, over a
    socket the replica answers (moeserve/engine/core_client.py `ProcessCore(lookup=...)`), which
    asks the draft deployment. Each question is numbered, so a late answer to a question that
    timed out is skipped."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._asked = 0

    def __call__(self, timeout_s: float) -> tuple[tuple[str, int], bytes]:
        self._asked += 1
        self._conn.send_bytes(pickle.dumps(self._asked))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                raise TimeoutError(f"the replica did not name the draft channel within {timeout_s} s")
            n, answer = pickle.loads(self._conn.recv_bytes())
            if n == self._asked:
                if isinstance(answer, str):  # the deployment's error, as text
                    raise RuntimeError(answer)
                return answer


def over_lookup(conn: Connection) -> RemoteDraftProposer:
    """The proposer of an engine core process whose replica has a draft deployment (pickled by
    reference into the core's spec: deployments/engine_server.py), its channel opened before the
    core serves."""
    proposer = RemoteDraftProposer(channel_source=ChannelLookup(conn))
    proposer.connect(START_CONNECT_TIMEOUT_S)
    return proposer
