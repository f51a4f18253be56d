"""The engine replica: one LLMEngine, its step loop on one background thread, async streams out.

Threads and ownership:

- the engine thread owns the LLMEngine and the table of live streams. It alone calls
  `add_request`, `step` and `abort`, so the engine needs no locks. Between steps it drains
  an inbox of commands (add / abort): that is where continuous batching admits requests.
- the event loop (Serve's replica loop, or a test's) runs `generate`: it compiles the
  grammar (off-loop, from the cache), posts an `add` command and awaits chunks on an
  asyncio.Queue that the engine thread fills with `loop.call_soon_threadsafe`, one call
  per step for all of that loop's streams.

No stream can hang: a chunk arrives for every step that touches its request; a failing
step ends every live stream with an INTERNAL error chunk; a dead engine thread ends them
with UNAVAILABLE and refuses new ones; a client that goes away (Serve cancels the
generator) posts an `abort`, which frees the request's KV slot before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deployments.engine_loader import EngineServerConfig, load_engine
from moeserve.engine import LLMEngine
from moeserve.grammar.errors import GrammarError
from moeserve.protocol import ErrorCode, GenerateChunk, GenerateRequest, Usage, error_chunk
from moeserve.sequence import RequestOutput
from router_service.stats import ExpertLoadStats

logger = logging.getLogger(__name__)

__all__ = ["EngineServer", "EngineServerConfig"]


@dataclass
class _Stream:
    """The engine thread's view of one live request."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue
    deadline: float | None  # time.monotonic() value, or None
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True)
class _Add:
    stream: _Stream
    request: GenerateRequest
    grammar: Any  # compiled grammar or None


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineServer:
    """Serves one LLMEngine to many concurrent async streams.

    Construct with a ready `engine` (tests) or let it build one from `config` (Serve).
    `compiler` compiles grammar specs (default: a GrammarCompiler over the engine's
    tokenizer); it must be safe to call from worker threads.
    """

    IDLE_WAIT_S = 0.05  # how often an idle loop wakes to check deadlines

    def __init__(
        self,
        config: EngineServerConfig,
        engine: LLMEngine | None = None,
        compiler: Any | None = None,
        draft: Any | None = None,
    ) -> None:
        """`draft`: a handle to the draft deployment; the engine then drafts through it."""
        self.config = config
        if config.torch_threads:
            import torch

            torch.set_num_threads(config.torch_threads)
        self.shard_group: Any = None
        if engine is None:
            proposer = None
            if draft is not None:
                from deployments.draft import RemoteDraftProposer

                proposer = RemoteDraftProposer(draft)
            engine, self.shard_group = load_engine(config, proposer)
        self.engine = engine
        self.compiler = compiler if compiler is not None else _default_compiler(self.engine)
        model = engine.runner.model
        self._load_stats = model.enable_stats() if self.shard_group is None and model.config.is_moe else None
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()  # guards _live and _dead
        self._live: set[str] = set()  # admitted and not yet finished (any thread may read)
        self._dead: str | None = None
        self._stopping = False
        self._counters: Counter[str] = Counter()
        self._step_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        if config.report_expert_load_s > 0:
            threading.Thread(target=self._report_expert_load, name="expert-load", daemon=True).start()

    # ---- the async API ---------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream `request`'s output; the last chunk has finish_reason set (and error, if any).

        Closing the generator early (client gone, Serve cancellation) aborts the request.
        """
        rid = request.request_id
        compiled = None
        if request.grammar is not None:
            try:
                compiled = await asyncio.to_thread(self.compiler.compile, request.grammar)
            except GrammarError as e:
                yield error_chunk(rid, ErrorCode.INVALID_ARGUMENT, str(e))
                return
        loop = asyncio.get_running_loop()
        deadline = None if request.timeout_s is None else time.monotonic() + request.timeout_s
        stream = _Stream(rid, loop, asyncio.Queue(), deadline)
        refusal = self._admit(stream, request, compiled)
        if refusal is not None:
            yield refusal
            return
        finished = False
        try:
            while not finished:
                chunk = await stream.chunks.get()
                if not chunk.finished and chunk.usage.completion_tokens > 1:
                    interval = self.config.stream_interval(len(self._live))
                    if interval:
                        await asyncio.sleep(interval)  # after the first token: fewer, larger messages
                while not chunk.finished and not stream.chunks.empty():  # coalesce a backlog
                    chunk = chunk.merge(stream.chunks.get_nowait())
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request of this replica; its stream ends with finish_reason "abort"."""
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    async def health(self) -> dict[str, Any]:
        """Liveness: raises RuntimeError when the engine thread is gone (Serve then restarts us)."""
        if self._dead is not None or not self._thread.is_alive():
            raise RuntimeError(f"engine loop stopped: {self._dead or 'thread exited'}")
        status: dict[str, Any] = {"status": "ok", "live_requests": len(self._live)}
        if self.shard_group is not None:  # a dead shard shows here before the next step trips on it
            status["shards"] = await asyncio.to_thread(self.shard_group.health)
        return status

    async def check_health(self) -> None:
        """Serve's health-check hook."""
        await self.health()

    def expert_load(self) -> list[dict[str, Any]]:
        """This replica's cumulative expert-load counters, one dict per rank (ExpertLoadStats.to_dict)."""
        if self.shard_group is not None:
            return self.shard_group.collect_stats()
        return [self._load_stats.to_dict()] if self._load_stats is not None else []

    def _report_expert_load(self) -> None:
        """Push counters to the router-service actor every few seconds (never per step)."""
        from deployments.router_actor import router_actor

        cfg, source = self.engine.runner.model.config, f"engine-{id(self):x}"
        import ray

        router, last = None, None
        while not self._stopping and self._dead is None:
            time.sleep(self.config.report_expert_load_s)
            try:
                if last is not None:
                    ray.get(last, timeout=self.config.report_expert_load_s)  # raises if the actor died
                router = router or router_actor(cfg.num_layers, cfg.num_experts)
                last = router.report.remote(source, self.expert_load())
            except Exception as e:  # statistics must never disturb serving
                if isinstance(e, ray.exceptions.RayActorError):
                    router = None  # gone (killed): find or create it again next time
                last = None
                logger.warning("could not report expert load", exc_info=True)

    async def stats(self) -> dict[str, Any]:
        """Counters and gauges for /metrics: requests, tokens, steps, batch, speculation, expert load."""
        sched = self.engine.scheduler
        load = await asyncio.to_thread(self.expert_load)
        experts = None
        if load:
            merged = ExpertLoadStats.from_dict(load[0])
            for other in load[1:]:
                merged.merge(ExpertLoadStats.from_dict(other))
            experts = merged.summary()
        return {
            "experts": experts,
            "live_requests": len(self._live),
            "running": len(sched.running),
            "kv_tokens_used": sched.kv_tokens_used,
            "kv_budget_tokens": sched.cfg.kv_budget,
            "preemptions": sched.num_preemptions,
            "waiting": len(sched.waiting),
            "max_num_seqs": sched.cfg.max_num_seqs,
            "steps": self._counters["steps"],
            "step_seconds_total": self._step_seconds,
            "step_errors": self._counters["step_errors"],
            "generated_tokens": self._counters["generated_tokens"],
            "requests": self._counters["requests"],
            "finished": {k[9:]: v for k, v in self._counters.items() if k.startswith("finished:")},
            "spec": self.engine.spec_metrics.to_dict() if self.engine.proposer is not None else {},
            "spec_disabled_steps": self.engine.num_spec_disabled_steps,
        }

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop; live streams end with UNAVAILABLE."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def __del__(self) -> None:
        self._stopping = True

    # ---- admission (event-loop side) ---------------------------------------------------------
    def _admit(self, stream: _Stream, request: GenerateRequest, compiled: Any) -> GenerateChunk | None:
        rid = request.request_id
        limit = self.engine.scheduler.cfg.max_num_seqs + self.config.max_queued_requests
        with self._lock:
            if self._dead is not None or self._stopping:
                return error_chunk(rid, ErrorCode.UNAVAILABLE, f"engine unavailable: {self._dead or 'shutting down'}")
            if rid in self._live:
                return error_chunk(rid, ErrorCode.INVALID_ARGUMENT, f"request id {rid!r} is already in use")
            if len(self._live) >= limit:
                return error_chunk(
                    rid, ErrorCode.RESOURCE_EXHAUSTED, f"engine queue is full ({limit} requests); retry later"
                )
            self._live.add(rid)
            self._inbox.put(_Add(stream, request, compiled))
        self._wake.set()
        return None

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        reason = "stopped"
        try:
            while not self._stopping:
                self._drain_inbox()
                self._expire_deadlines()
                if not self.engine.has_unfinished():
                    self._wake.wait(self.IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as e:  # the loop itself broke: nothing may keep waiting on it
            logger.exception("engine loop died")
            reason = f"engine loop died: {type(e).__name__}: {e}"
        finally:
            self._die(reason)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; ending every live request")
            self._counters["step_errors"] += 1
            self._fail_all(ErrorCode.INTERNAL, f"engine step failed: {type(e).__name__}: {e}")
            if self.shard_group is not None:  # a shard died (or a collective timed out): form a new group
                self.engine.runner = self.shard_group.restart()  # raising here ends the loop: UNAVAILABLE
            return
        self._step_seconds += time.perf_counter() - t0
        self._counters["steps"] += 1
        self._deliver([self._chunk(out) for out in outputs if out.request_id in self._streams])

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            else:
                self._add(cmd)

    def _add(self, cmd: _Add) -> None:
        req, stream = cmd.request, cmd.stream
        self._counters["requests"] += 1
        try:
            self.engine.add_request(
                list(req.prompt_ids), req.params, req.request_id, grammar=cmd.grammar, resume_ids=req.resume_ids
            )
        except ValueError as e:
            self._end(stream, error_chunk(req.request_id, ErrorCode.INVALID_ARGUMENT, str(e)))
            return
        self._streams[req.request_id] = stream

    def _abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self.engine.abort(request_id)
        self._end(stream, GenerateChunk(request_id, finish_reason="abort", usage=stream.usage))

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for stream in [s for s in self._streams.values() if s.deadline is not None and s.deadline <= now]:
            self.engine.abort(stream.request_id)
            msg = "request timed out in the engine"
            self._end(stream, error_chunk(stream.request_id, ErrorCode.DEADLINE_EXCEEDED, msg, stream.usage))

    def _chunk(self, out: RequestOutput) -> tuple[_Stream, GenerateChunk]:
        stream = self._streams[out.request_id]
        stream.usage = Usage(out.num_prompt_tokens, out.num_output_tokens)
        self._counters["generated_tokens"] += len(out.new_token_ids)
        reason = out.finish_reason if out.finished else None
        if out.finished:
            self._forget(stream, reason or "stop")
        return stream, GenerateChunk(out.request_id, tuple(out.new_token_ids), out.new_text, reason, stream.usage)

    def _end(self, stream: _Stream, chunk: GenerateChunk) -> None:
        self._forget(stream, chunk.finish_reason or "error")
        self._deliver([(stream, chunk)])

    def _forget(self, stream: _Stream, reason: str) -> None:
        self._streams.pop(stream.request_id, None)
        self._counters[f"finished:{reason}"] += 1
        with self._lock:
            self._live.discard(stream.request_id)

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        for stream in list(self._streams.values()):
            try:
                self.engine.abort(stream.request_id)
            except Exception:  # the engine is already broken; the stream still must end
                logger.exception("abort after a failed step")
            self._end(stream, error_chunk(stream.request_id, code, message, stream.usage))

    def _die(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
        self._fail_all(ErrorCode.UNAVAILABLE, reason)
        while True:  # commands posted before _dead was set
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._end(cmd.stream, error_chunk(cmd.request.request_id, ErrorCode.UNAVAILABLE, reason))

    @staticmethod
    def _deliver(items: list[tuple[_Stream, GenerateChunk]]) -> None:
        """Hand chunks to their event loops: one thread-safe call per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerateChunk]]] = {}
        for stream, chunk in items:
            by_loop.setdefault(stream.loop, []).append((stream.chunks, chunk))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: its streams have no reader left
                logger.warning("dropping %d chunks for a closed event loop", len(batch))


def _put_all(batch: list[tuple[asyncio.Queue, GenerateChunk]]) -> None:
    for chunks, chunk in batch:
        chunks.put_nowait(chunk)


def _default_compiler(engine: LLMEngine) -> Any:
    from moeserve.grammar import GrammarCompiler

    if engine.tokenizer is None:
        return None
    return GrammarCompiler(engine.tokenizer, engine.runner.vocab_size)
