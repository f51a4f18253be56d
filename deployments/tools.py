"""Tool calling for chat completions: `tools`, `tool_choice` and `parallel_tool_calls`, as OpenAI's.

    tool_choice   what the model may write                      how
    "none"        text only                                     tools left out of the prompt, calls dropped
    "auto"        text, or calls as <tool_call>{...}</tool_call>  parsed from the text (Hermes style)
    "required"    one call of any tool (parallel: one or more)  JSON-schema grammar: always valid
    {function}    exactly one call of that function             grammar: a call object with its name

`parallel_tool_calls: false` keeps at most one call. Calls reach the client as `message.tool_calls`
with finish_reason "tool_calls"; streamed, as one whole call per `delta.tool_calls` entry once
complete. A call cut by `max_tokens` is still a call (finish_reason "length"; its arguments are as
far as they got, a prefix of valid JSON), and the call syntax never reaches `content`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moeserve.errors import ErrorCode, ServingError
from moeserve.grammar.spec import GrammarSpec
from moeserve.tokenizer import CALL_CLOSE, CALL_OPEN

OPEN, CLOSE = CALL_OPEN, CALL_CLOSE
# a call, closed or cut off by the end of the text
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
# the start of a call object as the grammar writes it (name first), cut anywhere after the name
_PARTIAL = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*(?:,\s*"arguments"\s*:\s*(.*))?', re.DOTALL)
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


def tool_calling(tools: list[Tool] | None, choice: str | dict[str, Any] | None, parallel: bool,
                 grammar: GrammarSpec | None) -> tuple[ToolCalling | None, GrammarSpec | None]:
    """A chat request's ToolCalling (None without tools) and the grammar its output then needs
    (a required or named call's, or the request's own, never both)."""
    if not tools and choice in (None, "none", "auto"):
        return None, grammar
    calling = ToolCalling(tools or [], choice, parallel)
    forced = calling.grammar()
    if forced is not None and grammar is not None:
        raise ServingError(ErrorCode.INVALID_ARGUMENT, "a required or named tool_choice cannot be combined with "
                           "response_format or guided_* (the call's arguments already follow the function's schema)",
                           param="tool_choice")
    return calling, forced or grammar


class ToolCalling:
    """One chat request's tools: the grammar its output needs, and its text turned into calls."""

    def __init__(self, tools: list[Tool], choice: str | dict[str, Any] | None, parallel: bool) -> None:
        names = [t.function.name for t in tools]
        for name in names:
            if not _NAME.match(name):
                raise ValueError(f"tools: function name {name!r} must be 1-64 letters, digits, _ or -")
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        self.tools = {t.function.name: t.function for t in tools}
        self.parallel = parallel
        self.forced: list[str] = []  # the functions a call must be one of (empty: not forced)
        if choice is None or choice in ("auto", "none"):
            self.mode = "auto" if tools and choice != "none" else "none"
        elif choice == "required":
            if not tools:
                raise ValueError("tool_choice 'required' needs tools")
            self.mode, self.forced = "required", names
        elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
            if name not in self.tools:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
            self.mode, self.forced, self.parallel = "named", [name], False
        else:
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates expect them (transformers' `tools=` argument); none for "none",
        as vLLM's --exclude-tools-when-tool-choice-none: a model shown tools may call one anyway."""
        if self.mode == "none":
            return []
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.tools.values()]

    def call_prefix(self) -> str:
        """The reply's start a forced single call fixes in the Hermes syntax, its tag (`render_chat`
        puts it in the prompt where that is the template's): the grammar writes the call object
        after it, the name and the keys as forced text, so prompt + reply reads as a trained call."""
        return OPEN if self.forced and not self.parallel else ""

    def grammar(self) -> GrammarSpec | None:
        """For a forced call: a JSON schema admitting exactly the allowed calls, {"name", "arguments"}."""
        if not self.forced:
            return None
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": n}, "arguments": self.tools[n].parameters}} for n in self.forced]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "minItems": 1, "items": one} if self.parallel else one
        return GrammarSpec.json_schema(json.dumps(schema))

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The text as (content, tool_calls in OpenAI's shape); no calls: (text, []). A call the
        text cuts short comes back with the arguments written so far."""
        if self.mode == "none":  # whatever calls the model writes anyway are dropped
            return _without_calls(text), []
        if self.forced:
            body = text.strip()
            calls = _calls(body[1:] if self.parallel and body.startswith("[") else body, self.tools)
            if not calls and self.mode == "named":  # cut before its (forced) name was whole: still the call
                calls = [_call({"name": self.forced[0], "arguments": ""})]
            return None, calls
        calls = [c for body in _CALL.findall(text) for c in _calls(body, self.tools)]
        content = _without_calls(text).strip()
        return content or None, calls if self.parallel else calls[:1]

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice: passes text through until a call may start, then holds it back."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.text = ""  # everything generated
        self.sent = 0  # characters of it already streamed as content

    def feed(self, text: str) -> str:
        """Content to stream now for this new text."""
        self.text += text
        mode = self.calling.mode
        if mode in ("required", "named"):
            return ""
        start = self.text.find(OPEN, self.sent)
        if start < 0:  # hold back a tail that may be the start of "<tool_call>"
            start = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-k:]):
                    start = len(self.text) - k
                    break
        out, self.sent = self.text[self.sent : start], start
        return out

    def push(self, text: str, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """One engine chunk's (text, finish_reason): the content to send now, the calls (whole, once
        finished) and the finish reason to report."""
        text = self.feed(text)
        if finish_reason is None:
            return text, [], None
        rest, calls = self.finish()
        return text + rest, calls, finish_reason_with(calls, finish_reason)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: the content not yet streamed, and the calls."""
        _, calls = self.calling.split(self.text)
        rest, mode = self.text[self.sent :], self.calling.mode
        if mode in ("required", "named"):
            return "", calls
        return _without_calls(rest), calls


def finish_reason_with(calls: list[dict[str, Any]], finish_reason: str | None) -> str | None:
    """"tool_calls" once calls came, unless the output was cut ("length" stays)."""
    return "tool_calls" if calls and finish_reason != "length" else finish_reason


def _calls(text: str, tools: dict[str, FunctionDef]) -> list[dict[str, Any]]:
    """The call objects `text` holds one after another (`,` between them, a `]` after), the last
    perhaps cut short; those naming an unknown function are dropped."""
    out, pos, decoder = [], 0, json.JSONDecoder()
    while (pos := _skip(text, pos)) < len(text) and text[pos] != "]":
        try:
            c, pos = decoder.raw_decode(text, pos)
        except ValueError:  # cut short (or not JSON): the name and the arguments so far, if any
            if (m := _PARTIAL.match(text, pos)) and m.group(1) in tools:
                out.append(_call({"name": m.group(1), "arguments": (m.group(2) or "").strip()}))
            break
        if isinstance(c, dict) and c.get("name") in tools and isinstance(c.get("arguments", {}), dict):
            out.append(_call(c))
    return out


def _without_calls(text: str) -> str:
    """The text without its calls, nor the start of "<tool_call>" it was cut in (from "<t" on)."""
    text = _CALL.sub("", text)
    cut = next((k for k in range(len(OPEN) - 1, 1, -1) if text.endswith(OPEN[:k])), 0)
    return text[: len(text) - cut]


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
        pos += 1
    return pos


def _call(c: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's shape; arguments a dict, or (cut short) the text written so far."""
    args = c.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": c["name"], "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}
