"""The serving layer's output as OpenAI responses: the whole body, or its SSE chunks.

Bodies are plain dicts in OpenAI's exact shapes (building pydantic models per streamed chunk
costs more than the token did). With tools, the text becomes `tool_calls` (deployments/tools.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deployments.http_edge import error_body
from deployments.tools import ToolCalling
from moeserve.errors import as_serving_error
from moeserve.protocol import GenerateChunk, Usage
from moeserve.sampling_params import TokenLogprob, TokenTrace

SSE_DONE = "data: [DONE]\n\n"


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


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }

Merged = AsyncGenerator[tuple[int, GenerateChunk], None]


async def full_response(merged: Merged, n: int, builder: ResponseBuilder, calling: ToolCalling | None) -> dict:
    """The whole response of n choices; closes `merged` (also when the client went away)."""
    choices = [Choice(i) for i in range(n)]
    usage: list[Usage] = [Usage()] * n
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
            c.finish_reason = "tool_calls" if c.tool_calls else c.finish_reason
    return builder.full(choices, _total(usage))


async def sse_events(merged: Merged, n: int, builder: ResponseBuilder, include_usage: bool,
                     calling: ToolCalling | None) -> AsyncIterator[str]:
    """The response's SSE events, `data: [DONE]` last; an error mid-stream is an error event and
    then `data: [DONE]`. Closes `merged` (a client that went away aborts its requests)."""
    usage: list[Usage] = [Usage()] * n
    tools = [calling.stream() for _ in range(n)] if calling is not None else None
    try:
        if builder.chat:
            for i in range(n):
                yield builder.chunk("", first=True, index=i)
        async for i, chunk in merged:
            text, calls = chunk.text, []
            if tools is not None:  # content only outside tool calls; the calls once complete
                text = tools[i].feed(text)
                if chunk.finished:
                    rest, calls = tools[i].finish()
                    text += rest
            if calls:
                if text or chunk.logprobs or chunk.trace:
                    yield builder.chunk(text, index=i, logprobs=chunk.logprobs, trace=chunk.trace)
                yield builder.tool_calls_chunk(calls, index=i)
                yield builder.chunk("", "tool_calls", index=i)
            elif text or chunk.finished or chunk.logprobs or chunk.trace:
                yield builder.chunk(text, chunk.finish_reason, index=i, logprobs=chunk.logprobs, trace=chunk.trace)
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
