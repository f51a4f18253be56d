"""Tokenizer loading, chat rendering, and incremental detokenization.

`render_chat` goes through the tokenizer's chat template, else DEFAULT_CHAT_TEMPLATE (the demo
tokenizer's special tokens). Tools go as they are to templates that mention `tools` or
`tool_calls`; for others the conversation is rewritten Hermes-style (`in_plain_roles`), and a call
the request forces is begun in the prompt (`call_prefix`), as the demo pair learned its calls.

`IncrementalDetokenizer` streams text; two things make that harder than `decode(all_ids)`:

1. Byte-level BPE splits multi-byte characters across tokens; a prefix ending inside one
   decodes to U+FFFD, which must never reach the client. As in vLLM, text is final up to
   offset `read`; each push decodes only the window from `prefix` on and emits the part past
   the prefix text once it no longer ends in U+FFFD (O(window) per push).
2. Text that could start a stop string is held back until it completes one (then it and all
   after are dropped, as the OpenAI API does) or cannot anymore.

Invariant (tested): everything `push` and `finish` return, joined, equals
`tokenizer.decode(generated, skip_special_tokens=...)` for byte-level tokenizers, cut before
the first stop string.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded with the first window, so that decoders whose output depends on
# the previous token (SentencePiece's leading space) render the first generated token as
# it reads after the prompt. vLLM uses the same number.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request streaming decoder; the last few `prompt_ids` serve as context, and the output ends
    just before the first `stop` string to complete."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        if any(not s for s in stop):
            raise ValueError("stop must not contain an empty string")
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._stop = tuple(stop)

        context = [int(t) for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:]] if PROMPT_CONTEXT_TOKENS else []
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: a window starting there could never
            # line up with the generated text's own decoding, so start without context.
            context, context_text = [], ""
        self._window: list[int] = context  # token ids from the prefix offset on
        self._read = len(context)  # window[:read] is already turned into text
        self._prefix_text = context_text  # decode(window[:read])

        self._pending = ""  # final text not yet released: it may begin a stop string
        self._chunks: list[str] = []
        self.stop_reason: str | None = None  # the stop string that ended the output

    @property
    def stopped(self) -> bool:
        """True once a stop string has completed; later pushes return ""."""
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._chunks)

    def push(self, token_ids: Iterable[int] | int) -> str:
        """Add generated token ids; return the text that became final (maybe "")."""
        new_ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if self.stopped or not new_ids:
            return ""
        self._window.extend(new_ids)
        window_text = self._decode(self._window)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or the last character is still incomplete
        new_text = window_text[len(self._prefix_text) :]
        # window[read:] ended on a whole character, so it is the next prefix.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return self._release(new_text, final=False)

    def finish(self) -> str:
        """Flush: incomplete bytes become U+FFFD (as a full decode shows them) and any
        held-back prefix of a stop string is released."""
        if self.stopped:
            return ""
        window_text = self._decode(self._window)
        new_text = window_text[len(self._prefix_text) :]
        self._window, self._read, self._prefix_text = [], 0, ""
        return self._release(new_text, final=True)

    def _release(self, new_text: str, final: bool) -> str:
        pending = self._pending + new_text
        hit = _first_stop(pending, self._stop)
        if hit is not None:
            cut, self.stop_reason = hit
            out, self._pending = pending[:cut], ""
        else:
            hold = 0 if final else _stop_prefix_length(pending, self._stop)
            out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        if out:
            self._chunks.append(out)
        return out


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the occurrence that completes first; ties: earliest start."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        start = text.find(s)
        if start >= 0:
            key = (start + len(s), start, s)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[1], best[2])


def _stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    hold = 0
    for s in stops:
        for length in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:length]):
                hold = length
                break
    return hold


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The cheapest faithful decode: the Rust backend when there is one. No clean-up of
    tokenization spaces: it rewrites text across window boundaries (vLLM skips it too)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


CHAT_ROLES = ("system", "user", "assistant", "tool")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # the Hermes call syntax of `in_plain_roles`
TOOLS_PROMPT = ("You can call these functions. To call one, answer with "
                f'{CALL_OPEN}{{"name": <function name>, "arguments": <JSON object>}}{CALL_CLOSE}, one per call.')


def hermes_call(name: str, arguments: str | None = None) -> str:
    """A call in the Hermes syntax (arguments: JSON text); without arguments, its start up to the
    colon before them (the space is the first token of the arguments: ' {"')."""
    start = f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments":'
    return start if arguments is None else f"{start} {arguments}}}{CALL_CLOSE}"


DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in folder `path` (no network access). FileNotFoundError when the
    folder or its files are missing, ValueError when it has no EOS token."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise FileNotFoundError(
            f"no loadable tokenizer in {folder} (expected tokenizer.json or tokenizer_config.json): {error}"
        ) from error
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer in {folder} has no EOS token: set eos_token in its tokenizer_config.json")
    return tokenizer


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
                call_prefix: str = "") -> str:
    """Render chat messages ({"role": ..., "content": ...}; roles in CHAT_ROLES; an assistant
    message with `tool_calls` may lack content) and OpenAI function `tools` to the prompt text.
    call_prefix: the start of the reply a forced tool call fixes (`ToolCalling.call_prefix`), put
    after the generation prompt where the conversation is rewritten Hermes-style (a template
    that knows tools has its own call syntax: there the grammar alone forces the call).
    Bad messages raise ValueError saying which and why. Tokenize the result without adding
    special tokens: the template has them."""
    _check_messages(messages)
    template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    extra: dict[str, Any] = {} if tokenizer.chat_template else {"chat_template": DEFAULT_CHAT_TEMPLATE}
    if "tools" in template or "tool_calls" in template:
        plain, call_prefix = [dict(m) for m in messages], ""
        if tools:
            extra["tools"] = list(tools)
    else:
        plain = in_plain_roles(messages, tools)
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as error:
        raise ValueError(f"messages do not fit the chat template: {error}") from error
    return text + call_prefix if add_generation_prompt else text


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")


def in_plain_roles(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[dict]:
    """The conversation for a template that knows only system/user/assistant (Hermes style)."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        for call in m.get("tool_calls") or ():
            fn = call.get("function", {})
            args = fn.get("arguments", {})
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            content += hermes_call(fn.get("name"), args)
        out.append({"role": role, "content": content})
    if tools:
        listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        prompt = f"{TOOLS_PROMPT}\n<tools>\n{listed}\n</tools>"
        if out[0]["role"] == "system":
            out[0]["content"] += f"\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
