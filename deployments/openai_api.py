"""The OpenAI-compatible API: request bodies (pydantic) in as `ServeRequest`s, responses out.

Request models check types only (`SamplingParams` and `GrammarSpec` check values). Unknown fields
are ignored (as vLLM), known unsupported ones get a 400. Responses are plain dicts (cheaper per SSE chunk).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend import ServeRequest
from deployments.http_edge import error_body
from deployments.tools import Tool, ToolCalling, finish_reason_with, tool_calling
from moeserve.errors import ErrorCode, ServingError, as_serving_error
from moeserve.grammar.spec import GrammarSpec
from moeserve.protocol import GenerateChunk, Usage
from moeserve.sampling_params import MAX_LOGPROBS, TokenLogprob, TokenTrace

MAX_CHOICES = 16  # n: each choice is its own engine request
SSE_DONE = "data: [DONE]\n\n"


class StreamOptions(BaseModel):
    include_usage: bool = False


class TraceOptions(BaseModel):
    """The per-token trace (an extension): each token's experts and source (target, draft, grammar)."""

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


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


# ---- bodies as ServeRequests ---------------------------------------------------------------------
def completion_request(body: CompletionRequest, request_id: str) -> ServeRequest:
    """`POST /v1/completions`: one prompt (text or token ids), n choices."""
    _check_supported(body)
    if body.best_of not in (None, 1):
        raise _invalid("best_of must be 1", "best_of")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _invalid(f"prompt must be a single prompt, got a batch of {len(prompt)}", "prompt")
        prompt = prompt[0]
    return ServeRequest(body.model, prompt=prompt, max_tokens=body.max_tokens, sampling=_sampling(body, body.logprobs),
                        grammar=_grammar(body), n=body.n, request_id=request_id)


def chat_request(body: ChatCompletionRequest, request_id: str) -> tuple[ServeRequest, ToolCalling | None]:
    """`POST /v1/chat/completions`, and what its `tools` / `tool_choice` ask for (None without tools)."""
    _check_supported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
    calling, grammar = None, _grammar(body)
    if body.tools or body.tool_choice is not None:  # (a plain chat never reaches tools.py)
        calling, grammar = tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls, grammar)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req = ServeRequest(body.model, messages=_messages(body.messages),
                       tools=calling.template_tools() if calling is not None else None, max_tokens=max_tokens,
                       call_prefix=calling.call_prefix() if calling is not None else "",
                       sampling=_sampling(body, logprobs), grammar=grammar, n=body.n, request_id=request_id)
    return req, calling


def _invalid(message: str, param: str) -> ServingError:
    return ServingError(ErrorCode.INVALID_ARGUMENT, message, param=param)


def _check_supported(body: _Common) -> None:
    """400 for known OpenAI options this server does not implement (set to anything but their off value)."""
    for name in ("logit_bias", "presence_penalty", "frequency_penalty", "echo", "suffix"):
        if getattr(body, name, None):  # None, 0, False, "" and {} are off
            raise _invalid(f"{name} is not supported", name)


def _sampling(body: _Common, logprobs: int | None) -> dict[str, Any]:
    """SamplingParams fields (but max_tokens) the body sets."""
    out: dict[str, Any] = {"ignore_eos": body.ignore_eos, "logprobs": logprobs}
    if body.trace is not None:
        out |= {"trace_experts": body.trace.experts, "trace_speculation": body.trace.speculation}
    out |= body.model_dump(include={"temperature", "top_p", "top_k", "seed", "stop"}, exclude_none=True)
    if body.stop_token_ids:
        out["stop_token_ids"] = tuple(body.stop_token_ids)
    return out


def _grammar(body: _Common) -> GrammarSpec | None:
    fields = body.model_dump(include={"response_format", "guided_json", "guided_regex", "guided_grammar",
                                      "guided_choice"})
    return None if all(v is None for v in fields.values()) else GrammarSpec.from_request(**fields)


def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; content parts joined (text parts only)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise _invalid(f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                                   f"messages[{i}].content")
            content = "".join(part.text for part in content)
        d = {"role": m.role, "content": content if content is not None or m.tool_calls else ""}
        out.append(d | m.model_dump(include={"tool_calls", "tool_call_id"}, exclude_none=True))
    return out


# ---- responses -----------------------------------------------------------------------------------
@dataclass
class Choice:
    """One choice's output so far; with tool calls, `text` is the content besides them (None: none)."""

    index: int
    text: str | None = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    trace: list[TokenTrace] | None = None


class ResponseBuilder:
    """One request's full response or SSE chunks, in OpenAI's formats; `token_bytes(id)`: for logprobs."""

    def __init__(self, request_id: str, model: str, chat: bool,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.id, self.model, self.chat, self.created = request_id, model, chat, int(time.time())
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.token_bytes = token_bytes or (lambda token_id: b"")
        self._offsets: dict[int, int] = {}  # completions' text_offset, per choice

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, content: dict[str, Any], finish_reason: str | None,
                logprobs: Sequence[TokenLogprob] | None = None, trace: Sequence[TokenTrace] | None = None) -> dict:
        return ({"index": index, **content, "logprobs": self.logprobs(index, logprobs), "finish_reason": finish_reason}
                | self.trace(trace))

    def full(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        out = []
        for c in choices:
            message = {"role": "assistant", "content": c.text} | ({"tool_calls": c.tool_calls} if c.tool_calls else {})
            content = {"message": message} if self.chat else {"text": c.text}
            out.append(self._choice(c.index, content, c.finish_reason, c.logprobs, c.trace))
        return self._envelope("chat.completion" if self.chat else "text_completion", out) | {"usage": usage_dict(usage)}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False, index: int = 0,
              logprobs: Sequence[TokenLogprob] | None = None, trace: Sequence[TokenTrace] | None = None) -> str:
        delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}  # role: once
        content = {"delta": delta} if self.chat else {"text": text}
        return sse(self._envelope(self.chunk_object, [self._choice(index, content, finish_reason, logprobs, trace)]))

    def tool_calls_chunk(self, calls: list[dict[str, Any]], index: int = 0) -> str:
        """A chat delta with whole tool calls (id, name and all the arguments at once)."""
        delta = {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]}
        return sse(self._envelope(self.chunk_object, [self._choice(index, {"delta": delta}, None)]))

    def usage_chunk(self, usage: Usage) -> str:
        return sse({**self._envelope(self.chunk_object, []), "usage": usage_dict(usage)})

    def trace(self, entries: Sequence[TokenTrace] | None) -> dict[str, Any]:
        """{"trace": [{token, token_id, source, experts: [{layer, ids, weights}]}]}, or {} untraced."""
        if entries is None:
            return {}
        return {"trace": [{
            "token": self._token(e.token_id)[0], "token_id": e.token_id, "source": e.source,
            "experts": None if e.experts is None else [{"layer": layer, "ids": list(ids), "weights": list(weights)}
                                                       for layer, ids, weights in e.experts],
        } for e in entries]}

    def logprobs(self, index: int, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: OpenAI's four lists."""
        if entries is None:
            return None
        token = self._token  # (text, bytes)
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                text, raw = token(token_id)
                return {"token": text, "logprob": logprob, "bytes": raw}
            content = [entry(e.token_id, e.logprob) | {"top_logprobs": [entry(*top) for top in e.top]} for e in entries]
            return {"content": content, "refusal": None}
        tokens = [token(e.token_id)[0] for e in entries]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self._offsets.get(index, 0)))
        self._offsets[index] = offsets.pop()  # where the next chunk's text starts
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{token(i)[0]: lp for i, lp in e.top} for e in entries], "text_offset": offsets}

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text (bytes that are not UTF-8 replaced) and its bytes."""
        raw = self.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_dict(usage: Usage) -> dict[str, int]:
    return {**dataclasses.asdict(usage), "total_tokens": usage.total_tokens}


Merged = AsyncGenerator[tuple[int, GenerateChunk], None]  # (choice index, chunk), every choice's stream merged


async def full_response(merged: Merged, n: int, builder: ResponseBuilder, calling: ToolCalling | None) -> dict:
    """The whole response of n choices; closes `merged` (also when the client went away)."""
    choices, usage = [Choice(i) for i in range(n)], [Usage()] * n
    try:
        async for i, chunk in merged:
            c = choices[i]
            c.text += chunk.text
            if chunk.logprobs is not None:
                c.logprobs = (c.logprobs or []) + list(chunk.logprobs)
            if chunk.trace is not None:
                c.trace = (c.trace or []) + list(chunk.trace)
            c.finish_reason, usage[i] = chunk.finish_reason, chunk.usage
    finally:
        await merged.aclose()
    if calling is not None:
        for c in choices:
            c.text, c.tool_calls = calling.split(c.text)
            c.finish_reason = finish_reason_with(c.tool_calls, c.finish_reason)
    return builder.full(choices, _total(usage))


async def sse_events(merged: Merged, n: int, builder: ResponseBuilder, include_usage: bool,
                     calling: ToolCalling | None) -> AsyncIterator[str]:
    """The SSE events, `data: [DONE]` last (after an error event, if one comes mid-stream);
    closes `merged`, so a client that went away aborts its requests."""
    usage: list[Usage] = [Usage()] * n
    tools = [calling.stream() for _ in range(n)] if calling is not None else None
    try:
        if builder.chat:
            for i in range(n):
                yield builder.chunk("", first=True, index=i)
        async for i, chunk in merged:
            text, calls, finish = chunk.text, [], chunk.finish_reason
            if tools is not None:  # content only outside tool calls; the calls once complete
                text, calls, finish = tools[i].push(text, finish)
            if calls:
                if text or chunk.logprobs or chunk.trace:
                    yield builder.chunk(text, index=i, logprobs=chunk.logprobs, trace=chunk.trace)
                yield builder.tool_calls_chunk(calls, index=i)
                yield builder.chunk("", finish, index=i)
            elif text or chunk.finished or chunk.logprobs or chunk.trace:
                yield builder.chunk(text, finish, index=i, logprobs=chunk.logprobs, trace=chunk.trace)
            usage[i] = chunk.usage
        if include_usage:
            yield builder.usage_chunk(_total(usage))
        yield SSE_DONE
    except Exception as e:  # the status line is sent: the error goes in-band
        yield sse(error_body(as_serving_error(e)))
        yield SSE_DONE
    finally:
        await merged.aclose()


def _total(usage: list[Usage]) -> Usage:
    """Usage of all choices: the prompt once, every choice's completion tokens."""
    return Usage(usage[0].prompt_tokens, sum(u.completion_tokens for u in usage))
