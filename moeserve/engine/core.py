"""The engine core: the step loop, token ids in and token ids out over one channel.

The core owns an LLMEngine and no text, stop strings or HTTP. Its loop:

    drain the inbox (add / abort / stats) -> admit requests whose grammar has compiled
    -> engine.step() -> send one message with every request's new tokens

It runs in a thread (`InprocCore`) or its own process (`ProcessCore`), both in core_client.py.
Messages are moeserve/protocol.py's dataclasses; a channel has `send(msg)` and `recv(timeout)`.

Grammars compile here, on the compiler's threads: a request waits outside the scheduler until
its grammar is ready, so a slow compile never stalls the batch.

Failure isolation (`Isolation`): a step that fails before emitting anything (StepError) blames no
one yet. Its requests are requeued and run one at a time, ISOLATION_STEPS steps each (the
scheduler's `focus`). Failing alone twice (once could be a dying shard), a request is the cause
and ends with a non-retryable INTERNAL error; the others never see the failure.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from moeserve.engine.engine import LLMEngine, StepError
from moeserve.errors import ErrorCode
from moeserve.grammar.errors import GrammarError
from moeserve.protocol import (
    Abort,
    ApplyPlacement,
    CoreStopped,
    GenerateChunk,
    GenerateRequest,
    Resize,
    StatsReply,
    StatsRequest,
    Usage,
    error_chunk,
)
from moeserve.sequence import RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # an idle core blocks on its inbox this long at a time
ISOLATION_STEPS = 2  # steps a suspect runs alone (its prefill and a decode) to be cleared
ALONE_FAILURES = 2  # failures alone that make a request the cause


class Channel(Protocol):
    def send(self, msg: Any) -> None: ...

    def recv(self, timeout: float | None) -> Any | None:
        """The next message, or None when none came within `timeout` (0: do not wait)."""


class EngineCore:
    """Runs `engine` for the requests that arrive on a channel (`run`). `compiler` compiles
    GrammarSpecs (None: refused). `group`: the controls of the engine's shard group
    (deployments/elastic.py), used between steps: `recover()` after a failed step, `replace`
    (live re-placement), `request`/`due`/`apply` (width), `expert_load()` (every rank's counters)."""

    def __init__(self, engine: LLMEngine, compiler: Any = None, group: Any = None) -> None:
        self.engine, self.compiler, self.group = engine, compiler, group
        self._placement: ApplyPlacement | None = None  # the latest one asked for, applied before the next step
        self.counters: Counter[str] = Counter()
        self.step_seconds = 0.0
        self.stopping = False
        self.stop_reason: str | None = None  # set as the loop ends, before its streams are failed
        self._compiles = ThreadPoolExecutor(2, thread_name_prefix="core-grammar")
        self._compiling: dict[str, tuple[GenerateRequest, Future]] = {}
        self.isolation = Isolation(engine, self.counters)
        model = engine.runner.model
        self._load_stats = model.enable_stats() if group is None and model.config.is_moe else None

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, channel: Channel) -> None:
        """Serve `channel` until a Shutdown message, a closed channel or a broken loop."""
        reason = "stopped"
        try:
            while not self.stopping:
                idle = not self.engine.has_unfinished() and not self._compiling
                if not self._drain(channel, IDLE_WAIT_S if idle else 0.0):
                    break
                out = self._admit_compiled()
                if self.group is not None:
                    self._change_group()
                if self.engine.has_unfinished():
                    out += self._step()
                if out:
                    channel.send(out)
        except BaseException as e:  # the loop itself broke: nothing may keep waiting on it
            logger.exception("engine core loop died")
            reason = f"engine core died: {type(e).__name__}: {e}"
        finally:
            self.stop_reason = reason
            self._compiles.shutdown(wait=False, cancel_futures=True)
            self._stop_all(channel, reason)

    def _drain(self, channel: Channel, wait: float) -> bool:
        """Handle every message waiting (blocking up to `wait` for the first); False: shut down."""
        msg = channel.recv(wait)
        while msg is not None:
            if isinstance(msg, GenerateRequest):
                self._add(channel, msg)
            elif isinstance(msg, Abort):
                self._abort(channel, msg.request_id)
            elif isinstance(msg, StatsRequest):
                channel.send(StatsReply(msg.token, self.stats()))
            elif isinstance(msg, (ApplyPlacement, Resize)) and self.group is None:
                logger.warning("ignoring %r: this engine has no shard group", msg)
            elif isinstance(msg, ApplyPlacement):
                self._placement = msg
            elif isinstance(msg, Resize):
                self.group.request(msg.width)
            else:  # Shutdown
                return False
            msg = channel.recv(0)
        return True

    def _step(self) -> list[GenerateChunk]:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except StepError as e:  # nothing emitted: find the request that causes it, the rest carry on
            logger.warning("engine step failed with %d request(s) in it: %r", len(e.request_ids), e.__cause__)
            self.counters["step_errors"] += 1
            if self._reform():  # a rank died: the group failed, not a request; all carry on
                return []
            return self.isolation.failed(e.request_ids, e.__cause__)
        except Exception as e:  # failed after emitting tokens: nothing can be replayed here
            logger.exception("engine step failed; ending every live request")
            self.counters["step_errors"] += 1
            failed = self._fail_all(ErrorCode.INTERNAL, f"engine step failed: {type(e).__name__}: {e}")
            self._reform()
            return failed
        self.step_seconds += time.perf_counter() - t0
        self.counters["steps"] += 1
        self.isolation.stepped()
        return [_chunk(out) for out in outputs]

    def _change_group(self) -> None:
        """Between steps: live re-placement (caches kept) or a width change (running requests
        recompute); a failure re-forms the group."""
        msg, self._placement = self._placement, None
        sched = self.engine.scheduler
        try:
            if msg is not None:
                self.group.replace(msg.rank_experts)
                self.counters["expert_replacements"] += 1
            if self.group.due(len(sched.waiting), len(sched.running)):
                self._regroup(self.group.apply)
        except Exception:
            logger.exception("changing the shard group failed; re-forming it")
            self.counters["step_errors"] += 1
            self._reform()

    def _reform(self) -> bool:
        """After a failed step on a shard group: a new group, where running requests recompute.
        True when the group had lost a rank."""
        if self.group is None:
            return False
        lost = self.group.rank_failures
        self._regroup(self.group.recover)
        return self.group.rank_failures > lost

    def _regroup(self, form: Callable[[], Any]) -> None:
        self.engine.requeue([s.seq_id for s in self.engine.scheduler.running])
        self.engine.runner = form()  # raising in a re-form ends the loop: UNAVAILABLE

    # ---- requests ------------------------------------------------------------------------------
    def _add(self, channel: Channel, req: GenerateRequest) -> None:
        if req.grammar is None:
            refusal = self._start(req, None)
            if refusal is not None:
                channel.send([refusal])
            return
        if self.compiler is None:
            channel.send([error_chunk(req.request_id, ErrorCode.INVALID_ARGUMENT, "this engine has no grammar support")])
            return
        self._compiling[req.request_id] = (req, self._compiles.submit(self.compiler.compile, req.grammar))

    def _start(self, req: GenerateRequest, grammar: Any) -> GenerateChunk | None:
        """Hand the request to the engine; an error chunk if it refuses it."""
        try:
            self.engine.add_request(list(req.prompt_ids), req.params, req.request_id, grammar=grammar,
                                    resume_ids=req.resume_ids)
        except ValueError as e:
            return error_chunk(req.request_id, ErrorCode.INVALID_ARGUMENT, str(e))
        self.counters["requests"] += 1
        return None

    def _admit_compiled(self) -> list[GenerateChunk]:
        out = []
        for rid, (req, job) in list(self._compiling.items()):
            if not job.done():
                continue
            del self._compiling[rid]
            try:
                refusal = self._start(req, job.result())
            except GrammarError as e:
                refusal = error_chunk(rid, ErrorCode.INVALID_ARGUMENT, e.refusal(req.grammar.kind), param="grammar")
            except Exception as e:  # a compiler bug or a pathological grammar: refuse it, keep serving
                logger.exception("grammar compile failed")
                msg = f"could not compile the {req.grammar.kind} grammar: {type(e).__name__}: {e}"
                refusal = error_chunk(rid, ErrorCode.INVALID_ARGUMENT, msg, param="grammar")
            if refusal is not None:
                out.append(refusal)
        return out

    def _abort(self, channel: Channel, request_id: str) -> None:
        """Abort a request the core holds; its stream ends with finish_reason "abort"."""
        pending = self._compiling.pop(request_id, None)
        seq = self.engine.requests.get(request_id)
        if pending is None and seq is None:
            return  # already finished: its last chunk is on its way
        usage = Usage(len(seq.prompt_ids), len(seq.output_ids)) if seq is not None else Usage()
        self.engine.abort(request_id)
        channel.send([GenerateChunk(request_id, finish_reason="abort", usage=usage)])

    def _fail_all(self, code: ErrorCode, message: str) -> list[GenerateChunk]:
        out = []
        for rid, seq in list(self.engine.requests.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is already broken; the stream still must end
                logger.exception("abort after a failed step")
            out.append(error_chunk(rid, code, message, Usage(len(seq.prompt_ids), len(seq.output_ids))))
        out += [error_chunk(rid, code, message) for rid in self._compiling]
        self._compiling.clear()
        return out

    def _stop_all(self, channel: Channel, reason: str) -> None:
        try:
            channel.send(self._fail_all(ErrorCode.UNAVAILABLE, reason))
            channel.send(CoreStopped(reason))
        except Exception:  # the channel is gone too: the client notices that by itself
            logger.debug("could not report the core's stop", exc_info=True)

    # ---- statistics ----------------------------------------------------------------------------
    def expert_load(self) -> list[dict[str, Any]]:
        """Cumulative expert-load counters, one dict per rank (ExpertLoadStats.to_dict)."""
        if self.group is not None:
            return self.group.expert_load()
        return [self._load_stats.to_dict()] if self._load_stats is not None else []

    def stats(self) -> dict[str, Any]:
        """Gauges and counters of the engine: batch, KV, steps, speculation, grammar, expert load."""
        eng, sched = self.engine, self.engine.scheduler
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting) + len(self._compiling),
            "kv_tokens_used": sched.kv_tokens_used,
            "kv_budget_tokens": sched.cfg.kv_budget,
            "preemptions": sched.num_preemptions,
            "max_num_seqs": sched.cfg.max_num_seqs,
            "steps": self.counters["steps"],
            "step_seconds_total": self.step_seconds,
            "step_errors": self.counters["step_errors"],
            "expert_replacements": self.counters["expert_replacements"],
            "spec": eng.spec_metrics.to_dict() if eng.proposer is not None else {},
            # a draft deployment's own counters: pre-draft hit rate, time waited for drafts, fallbacks
            "draft": eng.proposer.stats() if hasattr(eng.proposer, "stats") else {},
            "spec_disabled_steps": eng.num_spec_disabled_steps,
            "spec_refused_steps": eng.adaptive.guard.num_refused if eng.adaptive is not None else 0,
            "grammar_guard_refusals": eng.num_guard_refusals,
            "grammar_cache": self.compiler.cache_info() if self.compiler is not None else {},
            "routing": _routing_gauges(eng.runner.model),
            "kv": eng.runner.stats() if hasattr(eng.runner, "stats") else {},  # paged: blocks, prefix-cache hits
            "expert_load": self.expert_load(),
        }


def _chunk(out: RequestOutput) -> GenerateChunk:
    usage = Usage(out.num_prompt_tokens, out.num_output_tokens)
    if out.error is not None:
        return error_chunk(out.request_id, ErrorCode.INTERNAL, out.error, usage, tuple(out.new_token_ids), "grammar")
    reason = out.finish_reason if out.finished else None
    logprobs = None if out.logprobs is None else tuple(out.logprobs)
    trace = None if out.trace is None else tuple(out.trace)
    return GenerateChunk(out.request_id, tuple(out.new_token_ids), finish_reason=reason, usage=usage, logprobs=logprobs,
                         trace=trace)


def _routing_gauges(model: Any) -> dict[str, float]:
    """The MoE layers' capacity settings as numbers for /metrics (overflow as a one-hot)."""
    if not (blocks := getattr(model, "moe_blocks", [])):
        return {}
    r = blocks[0].routing
    return {"capacity_factor": r.capacity_factor, "min_capacity": r.min_capacity,
            **{f"overflow_{o}": float(r.overflow == o) for o in ("none", "drop", "reroute")}}


class Isolation:
    """Finds the request that breaks a failing step (the module docstring); its neighbours carry on."""

    def __init__(self, engine: LLMEngine, counters: Counter[str]) -> None:
        self.engine, self.counters = engine, counters
        self.suspects: list[str] = []  # requests of failed steps, waiting to run alone
        self._alone_failures: Counter[str] = Counter()
        self._focus_steps = 0

    def failed(self, request_ids: list[str], cause: BaseException | None) -> list[GenerateChunk]:
        """A step failed before emitting: requeue its requests, run them alone; a culprit's error chunk."""
        focus = self.engine.scheduler.focus
        if focus is None or focus.seq_id not in request_ids:
            self.engine.requeue(request_ids)
            self.suspects += [rid for rid in request_ids if rid not in self.suspects]
            self._next()
            return []
        self._alone_failures[focus.seq_id] += 1
        if self._alone_failures[focus.seq_id] < ALONE_FAILURES:  # once more, in case the fault was not its own
            self.engine.requeue([focus.seq_id])
            self._focus_steps = 0
            return []
        self.counters["isolated_failures"] += 1
        chunk = error_chunk(focus.seq_id, ErrorCode.INTERNAL,
                            f"engine step failed with this request alone: {type(cause).__name__}: {cause}",
                            Usage(len(focus.prompt_ids), len(focus.output_ids)), retryable=False)
        self.engine.abort(focus.seq_id)
        self._next()
        return [chunk]

    def stepped(self) -> None:
        """A step succeeded: the request in focus is cleared after ISOLATION_STEPS of them."""
        sched = self.engine.scheduler
        if sched.focus is None and not self.suspects:
            return
        self._focus_steps += 1
        if sched.focus is None or self._focus_steps >= ISOLATION_STEPS:  # cleared (or finished)
            sched.focus = None
            self._next()

    def _next(self) -> None:
        """Focus the scheduler on the next suspect still alive (none left: back to batching)."""
        sched, live = self.engine.scheduler, self.engine.requests
        self.suspects = [rid for rid in self.suspects if rid in live]
        for rid in [r for r in self._alone_failures if r not in live]:
            del self._alone_failures[rid]
        if sched.focus is not None and sched.focus.seq_id in self.suspects:
            self.suspects.remove(sched.focus.seq_id)
        sched.focus = live[self.suspects.pop(0)] if self.suspects else None
        self._focus_steps = 0
