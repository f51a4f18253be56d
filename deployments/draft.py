"""The draft model as its own Serve deployment, and the engine-side proposer that calls it.

    engine step --one message per step, whole batch, on a socket--> DraftWorker (a child
                                                                    process of a DraftServer
                                                                    replica)

The user's design has "a separate draft-model deployment" propose tokens. Each replica of
the deployment runs one `DraftWorker`, which holds the model, in a child process of its own
(deployments/draft_worker.py `DraftProcess`); the engine asks the deployment once (a Serve
call) for its replica's data channel, then sends every step's call on that channel
(deployments/draft_channel.py). A Serve call costs ~4.5 ms here and an actor call ~1.5 ms
against a decode step of ~3 ms, so the transport decides whether drafting pays at all
(bench/reports/speculative.md). The per-step call carries every sequence of the step at once
(`DraftCall`) and returns all proposals; the engine never calls per sequence or per draft
token. After answering, the worker pre-drafts the next proposal of each row while the target
verifies (`DraftWorker.predraft`). `direct=False` keeps one Serve call per step instead.

State and routing: the draft keeps a KV cache per sequence, so each engine sticks to one
draft replica (Serve's consistent-hash router keyed by the engine's session id, and then
that replica's worker). Sticking is an optimisation, not a correctness condition: a worker
that sees a sequence it does not hold, or holds a stale copy of, rolls back to the common
prefix or rebuilds by prefilling (DraftModelProposer compares token ids every step).
Sequence ids are prefixed with the engine's session id, so two engines never share a draft
cache entry.

Lifetime and failure: the worker process exits with its replica, and the replica starts a
new one when it dies; the health check pings it, so Serve replaces a replica whose worker
cannot come back. When a call times out, fails, or the deployment is gone,
`RemoteDraftProposer` returns no drafts for that step (the engine decodes without
speculation, exact all the same), drops its connection, and backs off before trying again
(asking the deployment for the channel anew), doubling the pause up to a limit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.draft_worker import DraftCall, DraftProcess, DraftServerConfig
from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer

log = logging.getLogger(__name__)

STICKY_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


class DraftServer:
    """A draft replica: runs a DraftWorker in a child process (`DraftProcess`) and tells
    engines where its data channel is. The replica itself only supervises and waits, so its
    reservation (`ray_actor_options`) is the worker's: the child runs on the replica's node,
    with its CPUs (and its GPU, `CUDA_VISIBLE_DEVICES` being inherited).
    """

    def __init__(self, config: DraftServerConfig) -> None:
        self._process = DraftProcess(config)  # the model is loaded before the replica reports ready
        self._client: Any = None  # this replica's own connection, for Serve-call proposals
        self._client_to: Any = None
        self._client_lock = threading.Lock()

    async def channel(self) -> tuple[tuple[str, int], bytes]:
        """The address and secret of the worker's data channel: engines send every step's call
        there, not through Serve or Ray. Waits briefly while a dead worker is being restarted."""
        return await asyncio.to_thread(self._process.channel, 5.0)

    async def propose(self, call: DraftCall) -> list[Proposal]:
        """Proposals through Serve (one Serve call per step; RemoteDraftProposer(direct=False)),
        passed on over this replica's own connection to the worker."""
        return await asyncio.to_thread(self._propose, call)

    def _propose(self, call: DraftCall) -> list[Proposal]:
        from deployments.draft_channel import ChannelClient

        with self._client_lock:
            address, key = self._process.channel(30.0)
            if self._client is None or self._client_to != address:
                self._client, self._client_to = ChannelClient(address, key), address
            try:
                return self._client.call(call, 30.0)
            except Exception:
                self._client.close()
                self._client = None
                raise

    async def stats(self) -> dict[str, Any]:
        """This replica's worker's counters (a Serve call reaches the session's replica when sticky)."""
        return await asyncio.to_thread(self._process.stats)

    async def check_health(self) -> None:
        """Serve's health-check hook: a replica whose worker cannot be restarted gets replaced."""
        await asyncio.to_thread(self._process.check)

    def __del__(self) -> None:
        self._process.close()


def bind_draft(
    config: DraftServerConfig,
    num_replicas: int = 1,
    name: str = "draft",
    ray_actor_options: dict[str, Any] | None = None,
) -> Application:
    """The draft deployment, bound and ready for `serve.run` or for composition: pass the
    result to the engine deployment's bind() and Serve hands the engine a handle to it."""
    deployment = serve.deployment(
        DraftServer,
        name=name,
        num_replicas=num_replicas,
        # Each engine has at most one call in flight (plus a late one after a timeout).
        max_ongoing_requests=8,
        request_router_config=RequestRouterConfig(request_router_class=STICKY_ROUTER),
        ray_actor_options=ray_actor_options or {"num_cpus": 1},
    )
    return deployment.bind(config)


class RemoteDraftProposer(Proposer):
    """Engine-side proposer: one call to the draft deployment per engine step.

    handle: a DeploymentHandle to DraftServer.
    timeout_s: how long a step waits for drafts (or for the deployment to name its worker)
        before decoding without them.
    backoff_s, max_backoff_s: after a failure no call is made for backoff_s, doubling with
        each further failure up to max_backoff_s; a success resets it.
    sticky: route every Serve call of this engine to one replica (its session id).
    direct: talk to the replica's DraftWorker over its data channel (default: one socket message
        each way per step, its address asked of the deployment once), not through a Serve call
        per step.
    """

    def __init__(
        self,
        handle: Any,
        timeout_s: float = 0.5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        sticky: bool = True,
        direct: bool = True,
    ) -> None:
        if timeout_s <= 0 or backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError("need timeout_s > 0 and 0 <= backoff_s <= max_backoff_s")
        self.session = uuid.uuid4().hex[:12]
        routing = {"session_id": self.session} if sticky else {}
        self.handle = handle.options(method_name="propose", **routing)
        self.channel_handle = handle.options(method_name="channel", **routing) if direct else None
        self._client: Any = None  # the data channel to the replica's worker (direct)
        self.draft_wait_s = 0.0  # time steps spent waiting for drafts
        self.timeout_s, self.backoff_s, self.max_backoff_s = timeout_s, backoff_s, max_backoff_s
        self._pause_s = backoff_s
        self._retry_at = 0.0
        self._finished: deque[str] = deque(maxlen=100_000)  # the server's LRU covers any overflow
        self.num_calls = 0
        self.num_proposals = 0  # rows answered with drafts
        self.num_predraft_hits = 0  # of them, drafted ahead while the target verified (Proposal.predrafted)
        self.num_fallback_steps = 0  # steps decoded without drafts because of the deployment
        self.num_timeouts = 0
        self.num_errors = 0

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Drafts for the batch, or none at all (fallback) when the deployment is slow or gone."""
        empty = [Proposal([]) for _ in requests]
        asked = [r for r in requests if r.num_tokens > 0]
        if not asked:
            return empty
        if time.monotonic() < self._retry_at:
            self.num_fallback_steps += 1
            return empty
        finished = list(self._finished)
        self._finished.clear()
        prefix = self.session + "/"
        call = DraftCall(
            [ProposalRequest(prefix + r.seq_id, r.token_ids, r.num_tokens, r.params) for r in asked],
            [prefix + s for s in finished],
        )
        self.num_calls += 1
        try:
            got = self._call(call)
        except TimeoutError:
            self.num_timeouts += 1
            return self._fail(empty, finished, "timed out")
        except Exception as e:  # deployment deleted, replica died, serialization...: never fail the step
            self.num_errors += 1
            return self._fail(empty, finished, f"{type(e).__name__}: {e}")
        self._pause_s = self.backoff_s
        self.num_proposals += sum(1 for p in got if p.token_ids)
        self.num_predraft_hits += sum(1 for p in got if p.predrafted)
        by_id = dict(zip((r.seq_id for r in asked), got))
        return [by_id.get(r.seq_id, p) for r, p in zip(requests, empty)]

    def _call(self, call: DraftCall) -> list[Proposal]:
        t0 = time.perf_counter()
        try:
            if self.channel_handle is None:
                return self.handle.remote(call).result(timeout_s=self.timeout_s)
            return self._over_channel(call)
        finally:
            self.draft_wait_s += time.perf_counter() - t0

    def _over_channel(self, call: DraftCall) -> list[Proposal]:
        """The worker's data channel, its address asked of the deployment (one Serve call) on
        first use and after a failure."""
        if self._client is None:
            from deployments.draft_channel import ChannelClient

            address, key = self.channel_handle.remote().result(timeout_s=self.timeout_s)
            self._client = ChannelClient(address, key)
        try:
            return self._client.call(call, self.timeout_s)
        except Exception:  # timed out (a late reply would answer the next call) or the worker died
            self._client.close()
            self._client = None
            raise

    def on_finished(self, seq_id: str) -> None:
        """Queued; sent with the next call (no Serve call of its own)."""
        self._finished.append(seq_id)

    def stats(self) -> dict[str, float]:
        """Counters for /metrics (`moeserve_engine{name="draft_..."}`): calls, rows answered from a
        pre-draft and their share, steps decoded without drafts, and time steps waited for drafts."""
        return {
            "calls": self.num_calls,
            "proposals": self.num_proposals,
            "predraft_hits": self.num_predraft_hits,
            "predraft_hit_rate": self.num_predraft_hits / max(self.num_proposals, 1),
            "fallback_steps": self.num_fallback_steps,
            "timeouts": self.num_timeouts,
            "errors": self.num_errors,
            "wait_s": self.draft_wait_s,
            "wait_s_per_call": self.draft_wait_s / max(self.num_calls, 1),
        }

    def _fail(self, empty: list[Proposal], finished: list[str], why: str) -> list[Proposal]:
        # The call may not have arrived: send its finished ids again next time (freeing twice is harmless).
        self._finished.extendleft(reversed(finished))
        self.num_fallback_steps += 1
        self._retry_at = time.monotonic() + self._pause_s
        log.warning("draft deployment %s; decoding without drafts for %.1f s", why, self._pause_s)
        self._pause_s = min(self._pause_s * 2, self.max_backoff_s)
        return empty
