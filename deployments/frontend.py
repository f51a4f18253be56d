"""The serving layer HTTP and gRPC share: validate and tokenize on the way in; detokenize, stop
strings, usage and resume on the way back.

    body -> (gateway.py | grpc_server.py) -> Frontend.prepare: prompt ids, SamplingParams,
    GrammarSpec -> Frontend.stream: ONE streaming engine call, token ids back -> text here

The engine is token-in, token-out. Text is made once, here, by one incremental detokenizer per
request that also watches the stop strings: when one completes, the stream ends with "stop"
and closing the engine stream aborts the request there. Grammars are compiled only in the
engine core, where the masks are used; an invalid one comes back as the stream's first chunk
(INVALID_ARGUMENT, 400 before any token). The core checks every token it emits against its
grammar matcher (the guard); a refusal ends the stream with INTERNAL and counts in
`grammar_guard_refusals_total`, which the tests assert stays 0.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from deployments.metrics import GatewayMetrics
from deployments.openai_api import APIError
from moeserve.detokenizer import IncrementalDetokenizer
from moeserve.grammar.spec import GrammarSpec
from moeserve.protocol import ErrorCode, GenerateChunk, GenerateRequest, error_chunk
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import render_chat

# A failed step (INTERNAL) or an unreachable replica (UNAVAILABLE) is worth one more attempt.
RESUMABLE = (ErrorCode.INTERNAL, ErrorCode.UNAVAILABLE)
STALL_GRACE_S = 5.0  # past the request timeout, how long the gateway still waits for the engine's own error


class EngineClient(Protocol):
    """The engine as the gateway sees it: an EngineServer in-process, or a Serve handle wrapper."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]: ...

    async def health(self) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class FrontendConfig:
    """model_name: the one model id served; request_timeout_s: per request, engine side too."""

    model_name: str
    max_model_len: int
    request_timeout_s: float | None = 300.0
    max_retries: int = 2  # resumes of one stream after an engine replica or shard failure


@dataclass
class Prepared:
    """A validated request, ready to stream."""

    request: GenerateRequest
    route: str


class Frontend:
    def __init__(self, cfg: FrontendConfig, tokenizer: Any, engine: EngineClient, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.engine = engine
        self.metrics = metrics
        self.eos_token_id = tokenizer.eos_token_id

    @functools.cached_property
    def _vocab_bytes(self) -> list[bytes]:
        import xgrammar as xgr  # its decoded vocabulary knows every tokenizer kind's byte mapping

        return [bytes(b) for b in xgr.TokenizerInfo.from_huggingface(self.tokenizer).decoded_vocab]

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes (for logprobs); b"" for ids past the tokenizer's vocabulary."""
        vocab = self._vocab_bytes
        return vocab[token_id] if 0 <= token_id < len(vocab) else b""

    # ---- validation ----------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.cfg.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.cfg.model_name!r}",
                           param="model", code="model_not_found")

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", param="prompt")
            return list(self.tokenizer.encode(prompt))
        vocab = len(self.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad[0]}", param="prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = render_chat(self.tokenizer, messages, tools=tools)  # ValueError names the message -> 400
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def prepare(
        self,
        prompt_ids: list[int],
        make_params: Callable[[int], SamplingParams],
        max_tokens: int | None,
        grammar: GrammarSpec | None,
        route: str,
        request_id: str | None = None,
    ) -> Prepared:
        """Check the context length and build SamplingParams (max_tokens defaults to what fits).
        Raises APIError (or ValueError naming the field) for bad input."""
        limit, n = self.cfg.max_model_len, len(prompt_ids)
        if n >= limit:
            raise APIError(400, f"prompt has {n} tokens but the model's context is {limit} tokens "
                                "(the completion needs at least one more)", param="prompt",
                           code="context_length_exceeded")
        if max_tokens is not None and n + max_tokens > limit:
            raise APIError(400, f"this model's context is {limit} tokens; the prompt has {n} and max_tokens asks "
                                f"for {max_tokens} more ({n + max_tokens} in all)", param="max_tokens",
                           code="context_length_exceeded")
        params = make_params(limit - n if max_tokens is None else max_tokens)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        return Prepared(GenerateRequest(rid, tuple(prompt_ids), params, grammar, self.cfg.request_timeout_s), route)

    # ---- streaming -----------------------------------------------------------------------------
    async def stream(self, prep: Prepared) -> AsyncIterator[GenerateChunk]:
        """The engine's chunks with their text; ends with a finished chunk (maybe an error)."""
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
                    chunk = self._error(req, chunk)
                elif chunk.finished:
                    text += detok.finish()
                yield replace(chunk, text=text)
                if chunk.finished:
                    return
            yield error_chunk(req.request_id, ErrorCode.UNAVAILABLE, "engine stream ended without a finish")
        finally:
            m.in_flight.dec()
            m.prompt_tokens.inc(len(req.prompt_ids))
            m.e2e_seconds.labels(route=route).observe(time.perf_counter() - t0)

    def _error(self, req: GenerateRequest, chunk: GenerateChunk) -> GenerateChunk:
        """Name the request field behind a grammar error, and count refusals."""
        err = chunk.error
        if err.param != "grammar" or req.grammar is None:
            return chunk
        if err.code is ErrorCode.INVALID_ARGUMENT:
            self.metrics.grammar_refused.labels(kind=req.grammar.kind).inc()
        else:
            self.metrics.grammar_guard_refusals.inc()
        return replace(chunk, error=replace(err, param=_grammar_param(req.grammar)))

    async def _resumable_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The engine's chunks; when an attempt fails in a way a fresh attempt can fix (a dead
        replica, a broken shard group), resubmit with the tokens already streamed as
        `resume_ids`, so the client sees one stream and nothing accepted is lost."""
        delivered: list[int] = []
        for attempt in range(self.cfg.max_retries + 1):
            current = req
            if attempt:
                current = replace(req, request_id=f"{req.request_id}-resume{attempt}", resume_ids=tuple(delivered))
            async for chunk in self._engine_stream(current):
                retry = (
                    chunk.error is not None
                    and chunk.error.code in RESUMABLE
                    and chunk.error.retryable
                    and attempt < self.cfg.max_retries
                    and len(delivered) + len(chunk.token_ids) < req.params.max_tokens
                )
                delivered += chunk.token_ids
                if retry:
                    if chunk.token_ids:  # tokens coalesced with the error still reach the client
                        yield replace(chunk, request_id=req.request_id, finish_reason=None, error=None)
                    break
                yield replace(chunk, request_id=req.request_id)
                if chunk.finished:
                    return
            else:
                return
            self.metrics.retries.inc()

    async def _engine_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The engine's chunks; a failed call or a stalled engine ends the stream with an error."""
        # The engine enforces timeout_s itself; this backstop covers an engine that stopped answering.
        deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s + STALL_GRACE_S
        chunks = self.engine.generate(req)
        try:
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    yield await asyncio.wait_for(anext(chunks), left)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    msg = f"no answer from the engine within {req.timeout_s:g} s"
                    yield error_chunk(req.request_id, ErrorCode.DEADLINE_EXCEEDED, msg)
                    return
                except Exception as e:  # a dead replica or a lost connection: an error, never a hang
                    msg = f"engine call failed: {type(e).__name__}: {e}"
                    yield error_chunk(req.request_id, ErrorCode.UNAVAILABLE, msg)
                    return
        finally:
            await chunks.aclose()

def _grammar_param(spec: GrammarSpec) -> str:
    return {"json_object": "response_format", "json_schema": "response_format", "regex": "guided_regex",
            "ebnf": "guided_grammar", "choice": "guided_choice"}[spec.kind]
