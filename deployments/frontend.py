"""The serving layer HTTP and gRPC share: validate, tokenize and render the chat on the way in;
detokenize, stop strings, usage and resume on the way back (one streaming engine call per choice).

The engine is token-in, token-out: text is made once, here, by an incremental detokenizer per
request that also watches the stop strings. Every failure leaves this layer as a `ServingError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from deployments.metrics import GatewayMetrics
from moeserve.config import AppConfig
from moeserve.errors import ErrorCode, ServingError, as_serving_error
from moeserve.grammar.spec import GrammarSpec
from moeserve.protocol import GenerateChunk, GenerateRequest, StreamError, error_chunk
from moeserve.sampling_params import MAX_SEED, SamplingParams
from moeserve.tokenizer import IncrementalDetokenizer, render_chat

# A failed step (INTERNAL) or an unreachable replica (UNAVAILABLE) is worth one more attempt.
RESUMABLE = (ErrorCode.INTERNAL, ErrorCode.UNAVAILABLE)
STALL_GRACE_S = 5.0  # past the request timeout, how long the gateway still waits for the engine's own error


class EngineClient(Protocol):
    """The engine as the gateway sees it: an EngineServer in-process, or a Serve handle wrapper."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]: ...

    async def health(self) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ServeRequest:
    """A request before validation: `prompt` (text or ids) or `messages` (with `tools`); `sampling`:
    SamplingParams but max_tokens (None: what fits); choice i seeds seed + i; `timeout_s` only shortens."""

    model: str
    prompt: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    call_prefix: str = ""  # a forced tool call's start (ToolCalling.call_prefix)
    max_tokens: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    grammar: GrammarSpec | None = None
    n: int = 1
    request_id: str | None = None
    timeout_s: float | None = None


@dataclass(frozen=True)
class Prepared:
    """A validated request for one choice, ready to stream."""

    request: GenerateRequest
    route: str


class Frontend:
    def __init__(self, cfg: AppConfig, tokenizer: Any, engine: EngineClient, metrics: GatewayMetrics) -> None:
        """cfg: the whole tree (model.name, engine.max_model_len, gateway's timeout and retries)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.engine = engine
        self.metrics = metrics

    @functools.cached_property
    def _vocab_bytes(self) -> list[bytes]:
        import xgrammar as xgr  # its decoded vocabulary knows every tokenizer kind's byte mapping

        return [bytes(b) for b in xgr.TokenizerInfo.from_huggingface(self.tokenizer).decoded_vocab]

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes (for logprobs); b"" for ids past the tokenizer's vocabulary."""
        vocab = self._vocab_bytes
        return vocab[token_id] if 0 <= token_id < len(vocab) else b""

    # ---- validation ----------------------------------------------------------------------------
    def prepare(self, req: ServeRequest, route: str) -> list[Prepared]:
        """One engine request per choice; raises ServingError for bad input."""
        try:
            return self._prepare(req, route)
        except ValueError as e:  # SamplingParams and chat messages name the field
            raise as_serving_error(e) from None

    def _prepare(self, req: ServeRequest, route: str) -> list[Prepared]:
        if req.model != self.cfg.model.name:
            raise ServingError(ErrorCode.NOT_FOUND, f"model {req.model!r} does not exist; this server serves "
                               f"{self.cfg.model.name!r}", param="model", reason="model_not_found")
        prompt_ids = self.encode(req)
        limit, n = self.cfg.engine.max_model_len, len(prompt_ids)
        if n >= limit:
            raise ServingError(ErrorCode.INVALID_ARGUMENT, f"prompt has {n} tokens but the model's context is {limit} "
                               "tokens (the completion needs at least one more)", param="prompt",
                               reason="context_length_exceeded")
        if req.max_tokens is not None and n + req.max_tokens > limit:
            raise ServingError(ErrorCode.INVALID_ARGUMENT, f"this model's context is {limit} tokens; the prompt has {n} "
                               f"and max_tokens asks for {req.max_tokens} more ({n + req.max_tokens} in all)",
                               param="max_tokens", reason="context_length_exceeded")
        max_tokens = limit - n if req.max_tokens is None else req.max_tokens
        timeout = self.cfg.gateway.request_timeout_s
        if req.timeout_s is not None:  # the caller's deadline bounds the engine's work too
            timeout = max(min(req.timeout_s, timeout or req.timeout_s), 1e-3)
        base = req.request_id or f"req-{uuid.uuid4().hex}"
        preps = []
        for i in range(req.n):
            sampling = dict(req.sampling)
            if i and sampling.get("seed") is not None:
                sampling["seed"] = (sampling["seed"] + i) % (MAX_SEED + 1)
            params = SamplingParams(max_tokens=max_tokens, **sampling)
            rid = base if req.n == 1 else f"{base}-{i}"
            preps.append(Prepared(GenerateRequest(rid, tuple(prompt_ids), params, req.grammar, timeout), route))
        return preps

    def encode(self, req: ServeRequest) -> list[int]:
        """The prompt's token ids: the chat rendered by the template, the text encoded, or the ids checked."""
        if req.messages is not None:
            # ValueError names the message
            text = render_chat(self.tokenizer, req.messages, tools=req.tools, call_prefix=req.call_prefix)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        if not req.prompt:
            raise ServingError(ErrorCode.INVALID_ARGUMENT, "prompt is empty", param="prompt")
        if isinstance(req.prompt, str):
            return list(self.tokenizer.encode(req.prompt))
        vocab = len(self.tokenizer)
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise ServingError(ErrorCode.INVALID_ARGUMENT, f"prompt token ids must be in [0, {vocab}), got {bad[0]}",
                               param="prompt")
        return list(req.prompt)

    # ---- streaming -----------------------------------------------------------------------------
    async def generate(self, preps: list[Prepared]) -> AsyncGenerator[tuple[int, GenerateChunk], None]:
        """Every choice's (index, chunk) until each has finished; returns once every first chunk is in,
        so an early error raises before a response starts. Closing it aborts what still runs."""
        merged = _merge([self.stream(p) for p in preps])
        await anext(merged)
        return merged

    async def stream(self, prep: Prepared) -> AsyncIterator[GenerateChunk]:
        """The engine's chunks with their text, until a finished one; an error raises ServingError."""
        m, route, req = self.metrics, prep.route, prep.request
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.stop)
        t0 = last = time.perf_counter()
        first = True
        m.in_flight.inc()
        try:
            async for chunk in self._resumable_stream(req):
                if chunk.token_ids:
                    now = time.perf_counter()
                    if first:
                        m.ttft_seconds.labels(route=route).observe(now - t0)
                        first = False
                    else:
                        m.inter_token_seconds.observe((now - last) / len(chunk.token_ids))
                    last = now
                    m.generated_tokens.inc(len(chunk.token_ids))
                text = detok.push(chunk.token_ids)
                if detok.stopped:  # leaving the engine stream aborts the request there
                    yield replace(chunk, text=text, finish_reason="stop", error=None)
                    return
                if chunk.error is not None:
                    raise self._failure(req, chunk.error)
                if chunk.finished:
                    text += detok.finish()
                yield chunk.with_text(text)
                if chunk.finished:
                    return
            raise ServingError(ErrorCode.UNAVAILABLE, "engine stream ended without a finish")
        finally:
            m.in_flight.dec()
            m.prompt_tokens.inc(len(req.prompt_ids))
            m.e2e_seconds.labels(route=route).observe(time.perf_counter() - t0)

    def _failure(self, req: GenerateRequest, err: StreamError) -> ServingError:
        """An engine's in-band error as a ServingError, naming a grammar error's request field."""
        param, reason = err.param, None
        if err.param == "grammar" and req.grammar is not None:
            param = _grammar_param(req.grammar)
            if err.code is ErrorCode.INVALID_ARGUMENT:
                self.metrics.grammar_refused.labels(kind=req.grammar.kind).inc()
            else:
                self.metrics.grammar_guard_refusals.inc()
        if param and err.code is ErrorCode.INVALID_ARGUMENT:
            reason = "invalid_grammar"
        return ServingError(err.code, err.message, param=param, reason=reason)

    async def _resumable_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The engine's chunks; a resumable failure (dead replica, broken shard group) resubmits with
        the tokens streamed so far as `resume_ids`: the client sees one stream, nothing lost."""
        delivered: list[int] = []
        for attempt in range(self.cfg.gateway.max_retries + 1):
            current = req
            if attempt:
                current = replace(req, request_id=f"{req.request_id}-resume{attempt}", resume_ids=tuple(delivered))
            async for chunk in self._engine_stream(current):
                retry = (chunk.error is not None and chunk.error.code in RESUMABLE and chunk.error.retryable
                         and attempt < self.cfg.gateway.max_retries
                         and len(delivered) + len(chunk.token_ids) < req.params.max_tokens)
                delivered += chunk.token_ids
                if retry:
                    if chunk.token_ids:  # tokens coalesced with the error still reach the client
                        yield replace(chunk, request_id=req.request_id, finish_reason=None, error=None)
                    break
                yield chunk if chunk.request_id == req.request_id else replace(chunk, request_id=req.request_id)
                if chunk.finished:
                    return
            else:
                return
            self.metrics.retries.inc()

    async def _engine_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The engine's chunks; a failed call, or an engine silent past its own timeout, ends the stream
        with an error. (`asyncio.timeout_at` around each wait, not `wait_for`: that costs a task a chunk.)"""
        deadline = None if req.timeout_s is None else asyncio.get_running_loop().time() + req.timeout_s + STALL_GRACE_S
        chunks = self.engine.generate(req)
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    msg = f"no answer from the engine within {req.timeout_s:g} s"
                    yield error_chunk(req.request_id, ErrorCode.DEADLINE_EXCEEDED, msg)
                    return
                except Exception as e:  # a dead replica or a lost connection: an error, never a hang
                    yield error_chunk(req.request_id, ErrorCode.UNAVAILABLE, f"engine call failed: {type(e).__name__}: {e}")
                    return
                yield chunk
        finally:
            await chunks.aclose()


def _grammar_param(spec: GrammarSpec) -> str:
    return {"json_object": "response_format", "json_schema": "response_format", "regex": "guided_regex",
            "ebnf": "guided_grammar", "choice": "guided_choice"}[spec.kind]


async def _merge(streams: list[AsyncIterator[GenerateChunk]]) -> AsyncGenerator[Any, None]:
    """None once every stream's first chunk is in (or the first error), then (stream index, chunk)
    until each has finished. Closing it closes the streams (their engine requests abort)."""
    try:
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        for first in firsts:
            if isinstance(first, BaseException):
                raise first
        yield None
        if len(streams) == 1:
            yield 0, firsts[0]
            async for chunk in streams[0]:  # ends after the finished chunk
                yield 0, chunk
            return
        async with contextlib.aclosing(_interleave(firsts, streams)) as items:  # its tasks stop before the streams close
            async for item in items:
                yield item
    finally:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def _interleave(firsts: list[GenerateChunk], streams: list[AsyncIterator[GenerateChunk]]
                      ) -> AsyncIterator[tuple[int, GenerateChunk]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            await queue.put((i, firsts[i]))
            async for chunk in streams[i]:
                await queue.put((i, chunk))
        except BaseException as e:  # noqa: BLE001 - surfaced to the reader below
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        open_ = len(streams)
        while open_:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            open_ -= item.finished
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
