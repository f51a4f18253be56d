"""The draft model as its own Serve deployment, and the engine-side proposer that calls it.

    engine step --one message per step, whole batch, on a socket--> DraftWorker (owned by a
                                                                    DraftServer replica)

The user's design has "a separate draft-model deployment" propose tokens. Each replica of
the deployment owns one `DraftWorker` actor on its own node, which holds the model; the
engine asks the deployment once (a Serve call) for its replica's worker and the worker once
(an actor call) for its data channel, then sends every step's call on that channel
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

Lifetime and failure: the worker shares its replica's fate (an actor dies with its owner),
and the replica's health check pings it, so Serve replaces a replica whose worker died.
When a call times out, fails, or the deployment is gone, `RemoteDraftProposer` returns no
drafts for that step (the engine decodes without speculation, exact all the same), forgets
a worker that failed, and backs off before trying again (asking the deployment for a
worker anew), doubling the pause up to a limit.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer

log = logging.getLogger(__name__)

STICKY_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


@dataclass(frozen=True)
class DraftServerConfig:
    """What a draft replica loads. greedy: see DraftModelProposer (False samples drafts for
    sampled requests and returns q, which then crosses the wire: [k, V] floats per row)."""

    model_path: str
    max_num_seqs: int = 64
    max_model_len: int = 1024
    greedy: bool = True
    torch_threads: int | None = None
    device: str = "auto"  # the draft's own GPU when the replica has one (ray_actor_options num_gpus)
    dtype: str = "auto"
    predraft: bool = True  # draft the next proposal while the target verifies (DraftWorker.predraft)
    # Also pre-draft the outcomes where a draft is rejected (k more draft rows per sequence). On the
    # demo pair (batch 1, k=4) it raises the share of calls answered from a pre-draft from 43% to
    # 65%, but on one CPU core the extra rows cost more than they save (draft wait per call 2.7 ->
    # 5.3 ms): for a draft on a GPU of its own, where a few more rows are nearly free.
    predraft_partial: bool = False

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path: the draft checkpoint folder is required")
        for name in ("max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads: must be >= 1, got {self.torch_threads}")


@dataclass(frozen=True)
class DraftCall:
    """One engine step's request to the draft deployment.

    requests: every drafting sequence of the step (ids already session-prefixed).
    finished: sequences that ended since the last call; their KV slots are freed first.
    """

    requests: list[ProposalRequest]
    finished: list[str] = field(default_factory=list)


class DraftWorker:
    """The draft model: DraftModelProposer behind a lock (calls may overlap, e.g. a late call
    and the engine's retry). A plain class: in a DraftServer replica it runs as a Ray actor."""

    def __init__(self, config: DraftServerConfig) -> None:
        import torch

        from moeserve.spec.draft_model import DraftModelProposer

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        from model_shards import load_checkpoint
        from model_shards.device import resolve_device, resolve_dtype

        device = resolve_device(config.device)
        model = load_checkpoint(config.model_path, resolve_dtype(config.dtype, device), device=device)
        self.proposer = DraftModelProposer(model, config.max_num_seqs, config.max_model_len, config.greedy)
        self._lock = threading.Lock()
        self._calls = 0
        self._busy_s = 0.0
        self._id = uuid.uuid4().hex[:8]
        self._channel = None
        self._ahead: dict[str, dict[tuple[int, ...], list[int]]] = {}  # seq -> {assumed history: pre-drafted tokens}
        self._hypotheses: dict[str, set[str]] = {}  # seq -> the draft sequence ids of its partial outcomes
        self.proposer.track_runner_up = config.predraft and config.predraft_partial
        self._predraft_s = 0.0
        self.num_predraft_hits = 0
        self.num_predraft_misses = 0
        self.num_predraft_interrupted = 0
        self.num_predrafts = 0

    def propose(self, call: DraftCall) -> list[Proposal]:
        """Proposals for `call.requests`, in order: pre-drafted ones where the history is one
        they were drafted for, the rest drafted now (batched)."""
        with self._lock:
            t0 = time.perf_counter()
            for seq_id in call.finished:
                self.proposer.on_finished(seq_id)
                self._ahead.pop(seq_id, None)
                for hyp in self._hypotheses.pop(seq_id, ()):
                    self.proposer.on_finished(hyp)
            out: list[Proposal | None] = [None] * len(call.requests)
            for i, r in enumerate(call.requests):
                ahead = self._ahead.pop(r.seq_id, None)
                if ahead is None:
                    continue
                tokens = ahead.get(tuple(r.token_ids))
                if tokens:  # fewer than asked for when k grew since (adaptive k): still drafts for free
                    out[i] = Proposal(tokens[: r.num_tokens])
                    self.num_predraft_hits += 1
                else:
                    self.num_predraft_misses += 1
            todo = [i for i, p in enumerate(out) if p is None]
            if todo:
                for i, p in zip(todo, self.proposer.propose([call.requests[i] for i in todo])):
                    out[i] = p
            self._calls += 1
            self._busy_s += time.perf_counter() - t0
            return out

    def predraft(self, call: DraftCall, proposals: list[Proposal], peek: Callable[[], Any] | None = None) -> None:
        """After answering a call, while the target verifies it: draft each row's next proposal
        for the likely outcomes of that verification, and keep them keyed by the history each
        assumes. Outcome j < k: drafts 1..j accepted and the target's correction is the draft's
        own second choice at position j + 1; outcome k: every draft accepted and the bonus token
        is the draft's own next token (one propose of k + 1 tokens: the guess, then the next k).
        All outcomes of all rows are one batched propose; each partial outcome drafts under a
        sequence id of its own (`seq#j`), in slots that are free (pre-drafting never evicts).
        The next call answers from the outcome that happened. `peek()` is that call once it has
        arrived: if it brings a history no outcome assumed, pre-drafting stops at the next draft
        step (the engine is not kept waiting for guesses that missed); if every row's history is
        one being drafted, it runs to the end and the call is answered from it."""
        from moeserve.spec.draft_model import DraftInterrupted

        if not self.config.predraft or not self.proposer.greedy:
            return  # sampled drafts would be drawn ahead of the request's own keyed noise
        with self._lock:
            t0 = time.perf_counter()
            runner_up = self.proposer.runner_up
            free = self.proposer.runner.num_free_slots
            hyps: list[tuple[str, ProposalRequest]] = []  # (the row's seq id, what to draft)
            for r, p in zip(call.requests, proposals):
                if not p.token_ids or not r.num_tokens:
                    continue
                base = list(r.token_ids)
                hyps.append((r.seq_id, ProposalRequest(r.seq_id, base + p.token_ids, r.num_tokens + 1, r.params)))
                for j, alt in enumerate(runner_up.get(r.seq_id, [])[: len(p.token_ids)]):
                    hyp = f"{r.seq_id}#{j}"
                    if hyp not in self._hypotheses.get(r.seq_id, set()):
                        if free <= 0:
                            break
                        free -= 1
                        self._hypotheses.setdefault(r.seq_id, set()).add(hyp)
                    hyps.append((r.seq_id, ProposalRequest(hyp, base + p.token_ids[:j] + [alt], r.num_tokens,
                                                           r.params)))
            if not hyps:
                return
            self.num_predrafts += 1
            assumed = {(seq, tuple(h.token_ids)) for seq, h in hyps}

            def missed() -> bool:
                nxt = peek() if peek is not None else None
                if not isinstance(nxt, DraftCall):
                    return False
                return any((r.seq_id, tuple(r.token_ids)) not in assumed
                           and (r.seq_id, tuple(r.token_ids[:-1])) not in assumed for r in nxt.requests)

            try:
                got = self.proposer.propose([h for _, h in hyps], hypothetical=True, interrupted=missed)
            except DraftInterrupted:
                self.num_predraft_interrupted += 1
                return
            finally:
                self._predraft_s += time.perf_counter() - t0
            for (seq, h), p in zip(hyps, got):
                if h.seq_id == seq:  # every draft accepted: the first token is the guessed bonus
                    if len(p.token_ids) > 1:
                        self._ahead.setdefault(seq, {})[tuple(h.token_ids) + (p.token_ids[0],)] = p.token_ids[1:]
                elif p.token_ids:
                    self._ahead.setdefault(seq, {})[tuple(h.token_ids)] = p.token_ids

    def channel(self) -> tuple[tuple[str, int], bytes]:
        """The address and secret of this worker's data channel (opened on first ask): engines
        send every step's call there instead of through Ray."""
        with self._lock:
            if self._channel is None:
                from deployments.draft_channel import ChannelServer

                self._channel = ChannelServer(self.propose, self.predraft)
            return self._channel.address, self._channel.authkey

    def stats(self) -> dict[str, Any]:
        """This worker's counters."""
        p = self.proposer
        return {
            "replica": self._id,
            "calls": self._calls,
            "busy_s": self._busy_s,
            "tracked_seqs": p.num_tracked,
            "new_seqs": p.num_new_seqs,
            "rebuilt_tokens": p.num_rebuilt_tokens,
            "evictions": p.num_evictions,
            "predrafts": self.num_predrafts,
            "predraft_hits": self.num_predraft_hits,
            "predraft_misses": self.num_predraft_misses,
            "predraft_interrupted": self.num_predraft_interrupted,
            "predraft_s": self._predraft_s,
            "channel_connections": self._channel.num_connections if self._channel is not None else 0,
        }

    def ping(self) -> bool:
        return True


class DraftServer:
    """A draft replica: starts one DraftWorker actor on this replica's node and answers with it.

    The worker reserves no CPU of its own: the replica's reservation (`ray_actor_options`)
    covers it, since the replica itself only waits. It is not detached, so it dies with the
    replica.
    """

    def __init__(self, config: DraftServerConfig) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._worker = ray.remote(DraftWorker).options(num_cpus=0, scheduling_strategy=here).remote(config)
        ray.get(self._worker.ping.remote())  # the model is loaded before the replica reports ready

    def worker(self) -> Any:
        """The ActorHandle of this replica's worker: engines call it directly every step."""
        return self._worker

    async def propose(self, call: DraftCall) -> list[Proposal]:
        """Proposals through Serve (one Serve call per step; RemoteDraftProposer(direct=False))."""
        return await self._worker.propose.remote(call)

    async def stats(self) -> dict[str, Any]:
        """This replica's worker's counters (a Serve call reaches the session's replica when sticky)."""
        return await self._worker.stats.remote()

    async def check_health(self) -> None:
        """Serve's health-check hook: a replica whose worker died is unhealthy and gets replaced."""
        await self._worker.ping.remote()


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
        each way per step, set up once through Ray), not through a Serve call per step.
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
        self.worker_handle = handle.options(method_name="worker", **routing) if direct else None
        self._worker: Any = None  # the replica's DraftWorker once asked for (direct)
        self._client: Any = None  # the data channel to it (direct)
        self.draft_wait_s = 0.0  # time steps spent waiting for drafts
        self.timeout_s, self.backoff_s, self.max_backoff_s = timeout_s, backoff_s, max_backoff_s
        self._pause_s = backoff_s
        self._retry_at = 0.0
        self._finished: deque[str] = deque(maxlen=100_000)  # the server's LRU covers any overflow
        self.num_calls = 0
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
        by_id = dict(zip((r.seq_id for r in asked), got))
        return [by_id.get(r.seq_id, p) for r, p in zip(requests, empty)]

    def _call(self, call: DraftCall) -> list[Proposal]:
        t0 = time.perf_counter()
        try:
            if self.worker_handle is None:
                return self.handle.remote(call).result(timeout_s=self.timeout_s)
            return self._over_channel(call)
        finally:
            self.draft_wait_s += time.perf_counter() - t0

    def _over_channel(self, call: DraftCall) -> list[Proposal]:
        """The worker's data channel, set up through Ray on first use (and after a failure)."""
        if self._client is None:
            import ray

            from deployments.draft_channel import ChannelClient

            if self._worker is None:
                self._worker = self.worker_handle.remote().result(timeout_s=self.timeout_s)
            try:
                address, key = ray.get(self._worker.channel.remote(), timeout=self.timeout_s)
                self._client = ChannelClient(address, key)
            except Exception:  # the worker is gone: ask the deployment again next time
                self._worker = None
                raise
        try:
            return self._client.call(call, self.timeout_s)
        except Exception:  # timed out (a late reply would answer the next call) or the worker died
            self._client.close()
            self._client, self._worker = None, None
            raise

    def on_finished(self, seq_id: str) -> None:
        """Queued; sent with the next call (no Serve call of its own)."""
        self._finished.append(seq_id)

    def stats(self) -> dict[str, int]:
        return {
            "calls": self.num_calls,
            "fallback_steps": self.num_fallback_steps,
            "timeouts": self.num_timeouts,
            "errors": self.num_errors,
            "draft_wait_s": self.draft_wait_s,
        }

    def _fail(self, empty: list[Proposal], finished: list[str], why: str) -> list[Proposal]:
        # The call may not have arrived: send its finished ids again next time (freeing twice is harmless).
        self._finished.extendleft(reversed(finished))
        self.num_fallback_steps += 1
        self._retry_at = time.monotonic() + self._pause_s
        log.warning("draft deployment %s; decoding without drafts for %.1f s", why, self._pause_s)
        self._pause_s = min(self._pause_s * 2, self.max_backoff_s)
        return empty
