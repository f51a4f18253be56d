"""The OpenAI-compatible HTTP edge: request bodies (pydantic), response and SSE chunk bodies, errors.

Request models validate types only; values are checked by `SamplingParams` and
`GrammarSpec`, whose ValueErrors name the field, so one rule set serves HTTP and gRPC.
Unknown fields are ignored (as vLLM does); known but unsupported ones get a 400.

Responses are plain dicts in OpenAI's exact shapes (building pydantic models per streamed
chunk costs more than the token did).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.tools import Tool, ToolCalling
from moeserve.grammar.spec import GrammarSpec
from moeserve.protocol import ErrorCode, StreamError, Usage
from moeserve.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams, TokenLogprob, TokenTrace

MAX_CHOICES = 16  # n: each choice is its own engine request

# --- errors -----------------------------------------------------------------------------------

_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.RESOURCE_EXHAUSTED: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.INTERNAL: 500,
}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's `{"error": {...}}` body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_stream(cls, error: StreamError) -> APIError:
        """The HTTP error for an error that ended an engine stream."""
        code = "invalid_grammar" if error.param and error.code is ErrorCode.INVALID_ARGUMENT else error.code.value
        return cls(_STATUS[error.code], error.message, param=error.param, code=code)

    def body(self) -> dict[str, Any]:
        kind = _TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the HTTP API returns, whatever its status (OpenAI's shape)."""

    error: ErrorBody


_MEANING = {
    400: "bad input; the message names the field", 401: "missing or invalid API key",
    404: "unknown model", 413: "request body too large", 429: "this API key's concurrent-request limit",
    500: "server error", 503: "engine queue full or engine unavailable (Retry-After)", 504: "request timed out",
}


def error_responses(*statuses: int) -> dict[int, dict[str, Any]]:
    """FastAPI `responses=` documenting these error statuses with the error body's schema."""
    return {s: {"model": ErrorResponse, "description": _MEANING[s]} for s in statuses}


# --- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class TraceOptions(BaseModel):
    """The per-token trace (an extension): the experts each token was routed to, and whether it
    was decoded by the target, a draft token the target accepted, or forced by the grammar."""

    model_config = ConfigDict(extra="forbid")
    experts: bool = False
    speculation: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, each its own engine request (seed + i when seeded)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    trace: TraceOptions | None = None

    def check_supported(self) -> None:
        """400 for known OpenAI options this server does not implement."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (only 0)", param=name)

    def num_logprobs(self) -> int | None:
        """How many alternatives per token the response reports (None: no logprobs); the routes say."""
        return None

    def sampling_params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's SamplingParams for choice `choice` (its seed is seed + choice); ValueError
        names the bad field."""
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                                  "logprobs": self.num_logprobs()}
        if self.trace is not None:
            kwargs |= {"trace_experts": self.trace.experts, "trace_speculation": self.trace.speculation}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.seed is not None and choice:
            kwargs["seed"] = (self.seed + choice) % (MAX_SEED + 1)
        if self.stop is not None:
            kwargs["stop"] = self.stop
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(self.stop_token_ids)
        return SamplingParams(**kwargs)

    def grammar_spec(self) -> GrammarSpec | None:
        return GrammarSpec.from_request(
            response_format=self.response_format,
            guided_json=self.guided_json,
            guided_regex=self.guided_regex,
            guided_grammar=self.guided_grammar,
            guided_choice=self.guided_choice,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (OpenAI allows 5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids; batches of prompts are refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt must be a single prompt, got a batch of {len(p)}", param="prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise APIError(400, "prompt is empty", param="prompt")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise APIError(
                    400, f"messages[{index}].content[{j}]: only text parts are supported, got {part.type!r}",
                    param=f"messages[{index}].content",
                )
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def tool_calling(self) -> ToolCalling | None:
        """What `tools` / `tool_choice` ask for (None without tools)."""
        if not self.tools and self.tool_choice in (None, "none", "auto"):
            return None
        return ToolCalling(self.tools or [], self.tool_choice, self.parallel_tool_calls)

    def grammar_spec(self, calling: ToolCalling | None = None) -> GrammarSpec | None:
        """The output grammar: a forced tool call's, or the one the request asks for (not both)."""
        own = super().grammar_spec()
        forced = calling.grammar() if calling is not None else None
        if forced is not None and own is not None:
            raise APIError(400, "a required or named tool_choice cannot be combined with response_format or "
                                "guided_* (the call's arguments already follow the function's schema)",
                           param="tool_choice")
        return forced or own

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            d: dict[str, Any] = {"role": m.role, "content": None if m.content is None and m.tool_calls else m.text(i)}
            if m.tool_calls:
                d["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


# --- responses --------------------------------------------------------------------------------

ObjectKind = Literal["text_completion", "chat.completion"]


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


@dataclass
class Choice:
    """One choice's output so far (non-streaming: all of it); with tool calls, `text` is the
    content besides them (None when there is none)."""

    index: int
    text: str | None = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    trace: list[TokenTrace] | None = None


class ResponseBuilder:
    """Bodies for one request: the full response, or its SSE chunks, in OpenAI's formats.
    `token_bytes(id)` gives a token's bytes, for the logprobs' token strings."""

    def __init__(self, request_id: str, model: str, chat: bool,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.token_bytes = token_bytes or (lambda token_id: b"")
        self._offsets: dict[int, int] = {}  # completions' text_offset, per choice

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        if self.chat:
            body = self._envelope("chat.completion", [
                {"index": c.index, "message": {"role": "assistant", "content": c.text}
                 | ({"tool_calls": c.tool_calls} if c.tool_calls else {}),
                 "logprobs": self.logprobs(c.index, c.logprobs), "finish_reason": c.finish_reason}
                | self.trace(c.trace) for c in choices])
        else:
            body = self._envelope("text_completion", [
                {"index": c.index, "text": c.text, "logprobs": self.logprobs(c.index, c.logprobs),
                 "finish_reason": c.finish_reason} | self.trace(c.trace) for c in choices])
        body["usage"] = usage_dict(usage)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False, index: int = 0,
              logprobs: Sequence[TokenLogprob] | None = None, trace: Sequence[TokenTrace] | None = None) -> str:
        rendered = self.logprobs(index, logprobs)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": rendered, "finish_reason": finish_reason}
            return sse(self._envelope("chat.completion.chunk", [choice | self.trace(trace)]))
        choice = {"index": index, "text": text, "logprobs": rendered, "finish_reason": finish_reason}
        choice |= self.trace(trace)
        return sse(self._envelope("text_completion", [choice]))

    def tool_calls_chunk(self, calls: list[dict[str, Any]], index: int = 0) -> str:
        """A chat delta with whole tool calls (id, name and all the arguments at once)."""
        delta = {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return sse(self._envelope("chat.completion.chunk", [choice]))

    def trace(self, entries: Sequence[TokenTrace] | None) -> dict[str, Any]:
        """{"trace": [{token, token_id, source, experts: [{layer, ids, weights}]}]} when the request
        asked for a trace (source / experts null where not asked); {} otherwise."""
        if entries is None:
            return {}
        return {"trace": [{
            "token": self.token_bytes(e.token_id).decode("utf-8", errors="replace"), "token_id": e.token_id,
            "source": e.source,
            "experts": None if e.experts is None else [{"layer": layer, "ids": list(ids), "weights": list(weights)}
                                                       for layer, ids, weights in e.experts],
        } for e in entries]}

    def logprobs(self, index: int, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: tokens,
        token_logprobs, top_logprobs ({token: logprob}) and text_offset (from the completion's start)."""
        if entries is None:
            return None
        def token(token_id: int) -> tuple[str, list[int]]:
            raw = self.token_bytes(token_id)
            return raw.decode("utf-8", errors="replace"), list(raw)
        if self.chat:
            content = []
            for e in entries:
                text, raw = token(e.token_id)
                top = [{"token": t, "logprob": lp, "bytes": b} for (t, b), lp in ((token(i), lp) for i, lp in e.top)]
                content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, offsets, offset = [], [], self._offsets.get(index, 0)
        for e in entries:
            tokens.append(token(e.token_id)[0])
            offsets.append(offset)
            offset += len(tokens[-1])
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{token(i)[0]: lp for i, lp in e.top} for e in entries], "text_offset": offsets}

    def usage_chunk(self, usage: Usage) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._envelope(obj, []), "usage": usage_dict(usage)})


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
