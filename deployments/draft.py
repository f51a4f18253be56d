"""The draft model as its own Serve deployment (the engine's side of it:
deployments/draft_proposer.py `RemoteDraftProposer`).

    engine step --one message per step, whole batch, on a socket--> DraftWorker (a child
                                                                    process of a DraftServer
                                                                    replica)

The user's design has "a separate draft-model deployment" propose tokens. Each replica of
the deployment runs one `DraftWorker`, which holds the model, in a child process of its own
(deployments/draft_process.py `DraftProcess`); the engine asks the deployment once (a Serve
call) for its replica's data channel, then sends every step's call on that channel
(deployments/draft_channel.py). A Serve call costs more than a decode step and even an actor
call a good part of one, so the transport decides whether drafting pays at all
(bench/reports/speculative.md). The per-step call carries every sequence of the step at once
(`DraftCall`) and returns all proposals; the engine never calls per sequence or per draft
token. After answering, the worker pre-drafts the next proposal of each row while the target
verifies (`DraftWorker.predraft`) and pushes it; a step that finds its proposals pushed sends
an unanswered notice instead of a call. `direct=False` keeps one Serve call per step instead.

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
import threading
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.draft_channel import ChannelClient
from deployments.draft_process import DraftProcess
from deployments.draft_proposer import RemoteDraftProposer
from deployments.draft_worker import DraftCall, DraftServerConfig
from moeserve.spec.proposer import Proposal

__all__ = ["DraftServer", "DraftServerConfig", "RemoteDraftProposer", "bind_draft"]

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
