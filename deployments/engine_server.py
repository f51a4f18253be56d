"""The engine replica: supervises its engine core and turns the core's token batches into one
async stream per request.

    gateway --one streaming Serve call per request--> EngineServer.generate
        --GenerateRequest / Abort--> engine core (its own process)  --chunks, one list per step-->

The replica does no model work and no text: it admits requests (backpressure), forwards them
to the core, enforces deadlines, and hands each step's chunks to the waiting streams, coalescing
a stream's later chunks under load (every chunk is two Serve hops). With `gateway.direct_tokens`
(`generate_direct`) the chunks skip Serve: each gateway gets its requests' chunks of a step in one
message on its token socket (deployments/token_channel.py), and the Serve call only lasts.

The core runs in a process of its own (`engine.core_process`, the served default: no GIL shared
with Serve), or on a thread (`InprocCore`) when the engine is handed in (tests) or needs this
replica's Ray handles (a shard group). With a draft deployment its proposer is a
`RemoteDraftProposer` on the channel this replica asked for.

No stream can hang: every chunk reaches its stream; a dead core ends every live stream with
UNAVAILABLE (the gateway resumes them; a core process restarts); a client that goes away aborts
its request, freeing its KV slot before the next step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deployments.token_channel import TokenServer
from model_shards.device import resolve_device
from moeserve.config import AppConfig
from moeserve.engine import LLMEngine
from moeserve.engine.core import EngineCore
from moeserve.engine.core_client import InprocCore, ProcessCore
from moeserve.engine.factory import build_engine, model_path
from moeserve.errors import ErrorCode
from moeserve.protocol import Abort, GenerateChunk, GenerateRequest, Resize, Usage, error_chunk, hand_over, paced
from router_service.gating import ExpertLoadStats

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One live request: where its chunks go."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue  # a direct stream's: only chunks made here, and None once its last went out
    usage: Usage = field(default_factory=Usage)
    gateway: str | None = None  # direct: the gateway whose token socket gets its chunks


class EngineServer:
    """Serves one engine core to many concurrent async streams. `config`: the whole tree. Hand in
    a ready `engine` (tests: its core runs on a thread) or let the replica start the core (Serve);
    `compiler` compiles grammars for a handed-in engine; `draft`: the draft worker's channel, (address,
    secret) as the draft deployment's `channel` answers (deployments/app.py asks it)."""

    def __init__(self, config: AppConfig, engine: LLMEngine | None = None, compiler: Any | None = None,
                 draft: tuple[tuple[str, int], bytes] | None = None) -> None:
        self.config = config
        # seconds between chunks by live requests (the load saturates at max_num_seqs)
        self._intervals = [config.engine.stream_interval(n) for n in range(config.engine.max_num_seqs + 1)]
        if config.engine.torch_threads:
            import torch

            torch.set_num_threads(config.engine.torch_threads)
        self.shard_group: Any = None
        self.engine = engine  # None when the core runs in its own process
        self._lock = threading.Lock()  # guards _streams and _counters (event loops and the core's thread)
        self._streams: dict[str, _Stream] = {}  # admitted, and the core has not ended them yet
        self._counters: Counter[str] = Counter()
        self.stopping = False
        proposer = None
        if draft is not None:  # the draft deployment's channel (a worker's restart keeps it)
            from deployments.draft_channel import RemoteDraftProposer

            proposer = RemoteDraftProposer(draft)
        if engine is None and config.engine.core_process and config.shards.num_shards == 1:
            spec = (config, config.engine.torch_threads, proposer)
            self.core = ProcessCore(spec, self._on_chunks, self._on_dead)
            self.max_num_seqs = config.engine.max_num_seqs
        else:
            self.core = self._thread_core(engine, compiler, proposer)
            self.max_num_seqs = self.engine.scheduler.cfg.max_num_seqs
        self._reporter: threading.Thread | None = None
        if config.engine.expert_load_report_s > 0 and _in_ray():  # reporting needs Ray
            from deployments.router_actor import report_expert_load

            self._reporter = threading.Thread(target=report_expert_load, args=(self,), name="expert-load", daemon=True)
            self._reporter.start()

    def _thread_core(self, engine: LLMEngine | None, compiler: Any, proposer: Any) -> InprocCore:
        if engine is None:
            engine, self.shard_group = load_engine(self.config, proposer)
            self.engine = engine
        if compiler is None and engine.tokenizer is not None:
            from moeserve.grammar import GrammarCompiler

            grammar = self.config.grammar.grammar_config()
            compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, config=grammar)
        group = None
        if self.shard_group is not None:
            from deployments.elastic import ElasticGroup

            group = ElasticGroup(self.shard_group, self.config.shards, self.config.engine.max_num_seqs)
        core = EngineCore(engine, compiler, group)
        return InprocCore(core, self._on_chunks, self._on_dead)

    def resize(self, width: int) -> None:
        """Take the shard group to `width` ranks, one at a time between steps (deployments/elastic.py)."""
        if self.shard_group is None:
            raise ValueError("resize: this engine has no shard group (shards.num_shards is 1)")
        self.core.send(Resize(width))

    # ---- the async API ---------------------------------------------------------------------
    @functools.cached_property
    def tokens(self) -> TokenServer:
        return TokenServer()

    async def generate_direct(self, request: GenerateRequest, gateway: str) -> AsyncIterator[Any]:
        """`generate` with the chunks on `gateway`'s token socket (deployments/token_channel.py): first
        the socket's address, then only chunks made here; the call lasts as long as the request."""
        yield self.tokens.socket
        if not await asyncio.to_thread(self.tokens.wait_for, gateway, 10.0):
            yield error_chunk(request.request_id, ErrorCode.UNAVAILABLE, "the gateway did not connect to the token socket")
            return
        async for chunk in self.generate(request, gateway):
            yield chunk

    async def generate(self, request: GenerateRequest, gateway: str | None = None) -> AsyncIterator[GenerateChunk]:
        """Stream `request`'s new token ids; the last chunk has finish_reason set (and error, if any).
        Closing the generator early (client gone, Serve cancellation) aborts the request."""
        rid = request.request_id
        stream = _Stream(rid, asyncio.get_running_loop(), asyncio.Queue(), gateway=gateway)
        refusal = self._admit(stream, request)
        if refusal is not None:
            yield refusal
            return
        deadline = None if request.timeout_s is None else asyncio.get_running_loop().time() + request.timeout_s
        finished, first = False, True
        try:
            while not finished:
                try:  # a timeout around each wait (asyncio.wait_for would cost a task per chunk)
                    async with asyncio.timeout_at(deadline):
                        chunk = await stream.chunks.get()
                except TimeoutError:
                    yield error_chunk(rid, ErrorCode.DEADLINE_EXCEEDED, "request timed out in the engine",
                                      stream.usage)
                    return  # the finally aborts it in the core
                if chunk is None:  # a direct stream's last chunk went on the token socket
                    finished = True
                    return
                interval = self._intervals[min(len(self._streams), len(self._intervals) - 1)]
                chunk = await paced(chunk, stream.chunks, interval, first)
                finished, first = chunk.finished, False
                yield chunk
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request of this replica; its stream ends with finish_reason "abort"."""
        self.core.send(Abort(request_id))

    async def health(self) -> dict[str, Any]:
        """Liveness: raises RuntimeError when the core is gone for good (Serve then restarts us)."""
        if not self.core.alive:
            raise RuntimeError(f"engine loop stopped: {self.core.why_stopped or 'closed'}")
        status: dict[str, Any] = {"status": "ok", "live_requests": len(self._streams),
                                  "core_restarts": self.core.restarts}
        if self.shard_group is not None:  # a dead shard shows here before the next step trips on it
            status["shards"] = await asyncio.to_thread(self.shard_group.health)
        return status

    async def check_health(self) -> None:
        """Serve's health-check hook."""
        await self.health()

    def expert_load(self) -> list[dict[str, Any]]:
        """This replica's cumulative expert-load counters, one dict per rank (ExpertLoadStats.to_dict)."""
        return self.core.stats()["expert_load"]

    async def stats(self) -> dict[str, Any]:
        """Counters and gauges for /metrics: requests, tokens, steps, batch, speculation, expert load."""
        with self._lock:
            counters = dict(self._counters)
        out: dict[str, Any] = {
            "live_requests": len(self._streams),
            "requests": counters.get("requests", 0),
            "generated_tokens": counters.get("generated_tokens", 0),
            "finished": {k[9:]: v for k, v in counters.items() if k.startswith("finished:")},
            "core_restarts": self.core.restarts,
        }
        group = self.shard_group
        if group is not None:  # width, rank failures served through, the last re-form's pause
            out["shard_group"] = {"width": group.width, "generation": group.generation, "resizes": group.resizes,
                                  "rank_failures_survived": group.rank_failures_survived,
                                  "last_recovery_s": group.last_recovery_s}
        try:
            core = await asyncio.to_thread(self.core.stats)
        except Exception as e:  # a dead or restarting core: the replica's own counters still answer
            return out | {"core_error": f"{type(e).__name__}: {e}", "experts": None}
        load = core.pop("expert_load")
        experts = None
        if load:
            merged = ExpertLoadStats.from_dict(load[0])
            for other in load[1:]:
                merged.merge(ExpertLoadStats.from_dict(other))
            experts = merged.summary()
        return core | out | {"experts": experts}

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core and the load reporter; live streams end with UNAVAILABLE."""
        self.stopping = True
        self.core.close(timeout)
        if "tokens" in self.__dict__:
            self.tokens.close()
        if self._reporter is not None:  # it must not call Ray after the caller shuts Ray down
            self._reporter.join(timeout)
        self._on_dead("engine replica shutting down")

    def __del__(self) -> None:
        self.stopping = True

    # ---- admission (event-loop side) ---------------------------------------------------------
    def _admit(self, stream: _Stream, request: GenerateRequest) -> GenerateChunk | None:
        rid = request.request_id
        limit = self.max_num_seqs + self.config.engine.max_queued_requests
        with self._lock:
            if not self.core.alive or self.stopping:
                return error_chunk(rid, ErrorCode.UNAVAILABLE,
                                   f"engine unavailable: {self.core.why_stopped or 'shutting down'}")
            if rid in self._streams:
                return error_chunk(rid, ErrorCode.INVALID_ARGUMENT, f"request id {rid!r} is already in use")
            if len(self._streams) >= limit:
                return error_chunk(rid, ErrorCode.RESOURCE_EXHAUSTED,
                                   f"engine queue is full ({limit} requests); retry later")
            self._streams[rid] = stream
            self._counters["requests"] += 1
        self.core.send(request)
        return None

    # ---- what the core sends (its thread) ----------------------------------------------------
    def _on_chunks(self, chunks: list[GenerateChunk]) -> None:
        """One step's chunks, to their streams (a direct stream's to its gateway's socket)."""
        delivered: list[tuple[_Stream, GenerateChunk | None]] = []
        direct: dict[str, list[GenerateChunk]] = {}
        with self._lock:
            for chunk in chunks:
                stream = self._streams.get(chunk.request_id)
                if stream is None:
                    continue
                stream.usage = chunk.usage
                self._counters["generated_tokens"] += len(chunk.token_ids)
                if chunk.finished:
                    del self._streams[chunk.request_id]
                    self._counters[f"finished:{chunk.finish_reason}"] += 1
                if stream.gateway is None:
                    delivered.append((stream, chunk))
                    continue
                direct.setdefault(stream.gateway, []).append(chunk)
                if chunk.finished:  # ends the Serve call
                    delivered.append((stream, None))
        for gateway in self.tokens.send(direct) if direct else ():  # gone: its requests stop
            for chunk in direct[gateway]:
                self.abort(chunk.request_id)
        _deliver(delivered)

    def _on_dead(self, reason: str) -> None:
        """The core is gone (a process core restarts): every live stream ends with UNAVAILABLE."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            self._counters["finished:error"] += len(streams)
        if streams:
            logger.error("engine core stopped with %d live requests: %s", len(streams), reason)
        _deliver([(s, error_chunk(s.request_id, ErrorCode.UNAVAILABLE, reason, s.usage)) for s in streams])


def load_engine(config: AppConfig, proposer: Any = None) -> tuple[LLMEngine, Any]:
    """The engine `config` names, and its shard group of Ray actors (None: the model runs here)."""
    e, shards = config.engine, config.shards
    if shards.num_shards == 1:
        return build_engine(config, proposer=proposer), None
    from deployments.router_actor import proposed_placement
    from deployments.shard_group import ShardGroup, ShardGroupConfig

    per_rank = -(-e.max_num_seqs // shards.num_shards)  # sequences are spread over the ranks
    group_cfg = ShardGroupConfig(
        model_path(config), world_size=shards.num_shards, max_num_seqs=per_rank, max_model_len=e.max_model_len,
        block_size=e.block_size, prefix_caching=e.prefix_caching, compile=e.compile, routing=config.routing,
        dtype=config.model.dtype, strategy=shards.strategy, gpus_per_shard=shards.gpus_per_shard,
        redundancy=shards.redundancy,
    )  # fmt: skip
    if e.device != "auto" and resolve_device(e.device) != group_cfg.device:
        raise ValueError(f"engine.device {e.device!r} and shards.gpus_per_shard {shards.gpus_per_shard} "
                         f"disagree: a shard group runs every rank on {group_cfg.device}")
    group = ShardGroup(group_cfg, placement=proposed_placement(shards.num_shards))
    return build_engine(config, runner=group.start(), proposer=proposer), group


def _in_ray() -> bool:
    """Whether this process is connected to Ray (a Serve replica); never imports or starts it."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _deliver(items: list[tuple[_Stream, GenerateChunk | None]]) -> None:
    hand_over([(stream.loop, stream.chunks, chunk) for stream, chunk in items])
