"""The OpenAI-compatible API's request bodies (pydantic), each turned into the serving layer's
`ServeRequest` by `completion_request` / `chat_request`.

Request models validate types only; values are checked by `SamplingParams` (in the serving
layer) and `GrammarSpec`, whose ValueErrors name the field, so one rule set serves HTTP and
gRPC. Unknown fields are ignored (as vLLM does); known but unsupported ones get a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend import ServeRequest
from deployments.tools import Tool, ToolCalling
from moeserve.errors import ErrorCode, ServingError
from moeserve.grammar.spec import GrammarSpec
from moeserve.sampling_params import MAX_LOGPROBS

MAX_CHOICES = 16  # n: each choice is its own engine request


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
    if body.echo:
        raise _invalid("echo is not supported", "echo")
    if body.best_of not in (None, 1):
        raise _invalid("best_of must be 1", "best_of")
    if body.suffix:
        raise _invalid("suffix is not supported", "suffix")
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
    calling = None
    if body.tools or body.tool_choice not in (None, "none", "auto"):
        calling = ToolCalling(body.tools or [], body.tool_choice, body.parallel_tool_calls)
    grammar = _grammar(body)
    forced = calling.grammar() if calling is not None else None
    if forced is not None and grammar is not None:
        raise _invalid("a required or named tool_choice cannot be combined with response_format or guided_* (the "
                       "call's arguments already follow the function's schema)", "tool_choice")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req = ServeRequest(body.model, messages=_messages(body.messages),
                       tools=calling.template_tools() if calling is not None else None, max_tokens=max_tokens,
                       sampling=_sampling(body, logprobs), grammar=forced or grammar, n=body.n, request_id=request_id)
    return req, calling


def _invalid(message: str, param: str) -> ServingError:
    return ServingError(ErrorCode.INVALID_ARGUMENT, message, param=param)


def _check_supported(body: _Common) -> None:
    """400 for known OpenAI options this server does not implement."""
    if body.logit_bias:
        raise _invalid("logit_bias is not supported", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise _invalid(f"{name} is not supported (only 0)", name)


def _sampling(body: _Common, logprobs: int | None) -> dict[str, Any]:
    """SamplingParams fields (but max_tokens) the body sets."""
    out: dict[str, Any] = {"ignore_eos": body.ignore_eos, "logprobs": logprobs}
    if body.trace is not None:
        out |= {"trace_experts": body.trace.experts, "trace_speculation": body.trace.speculation}
    for name in ("temperature", "top_p", "top_k", "seed", "stop"):
        if getattr(body, name) is not None:
            out[name] = getattr(body, name)
    if body.stop_token_ids:
        out["stop_token_ids"] = tuple(body.stop_token_ids)
    return out


def _grammar(body: _Common) -> GrammarSpec | None:
    fields = {"response_format": body.response_format, "guided_json": body.guided_json,
              "guided_regex": body.guided_regex, "guided_grammar": body.guided_grammar,
              "guided_choice": body.guided_choice}
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
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None or m.tool_calls else ""}
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
