"""Tokenizer loading and chat rendering.

`load_tokenizer` reads a Hugging Face tokenizer folder (usually the checkpoint folder)
and insists on an EOS token, since generation cannot end without one.

`render_chat` turns OpenAI-style messages into the prompt string, through the
tokenizer's own chat template when it has one, else through DEFAULT_CHAT_TEMPLATE:

    <|system|>
    You are a helpful assistant.<|end|>
    <|user|>
    Hello<|end|>
    <|assistant|>

The markers are the demo tokenizer's special tokens; for a tokenizer that lacks them
they are plain text, which still gives the model an unambiguous transcript.

Tools (`tools=`, assistant messages with `tool_calls`, `tool` messages with the results) go to
templates that know them (any that mentions `tools` or `tool_calls`: Qwen, Mistral, Llama 3,
...) as they are. For templates that do not (the demo's), the conversation is rewritten
into the roles they know, in the Hermes style: the tools are listed in the system message
with how to call them (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), earlier
calls are appended to their assistant message that way, and each result becomes a user
message inside `<tool_response>` ... `</tool_response>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant", "tool")
TOOLS_PROMPT = ("You can call these functions. To call one, answer with "
                '<tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call>, one per call.')

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in folder `path` (no network access).

    Raises FileNotFoundError when the folder or its tokenizer files are missing, and
    ValueError when the tokenizer has no EOS token; both name the folder.
    """
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


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Render chat messages ({"role": ..., "content": ...}) to the prompt text.

    Roles are "system", "user", "assistant" and "tool"; content is a string (an assistant
    message with `tool_calls` may have none). `tools`: OpenAI function tools. Bad messages
    (and templates that reject the conversation) raise ValueError saying which message and
    why. Tokenize the result without adding special tokens: the template has them.
    """
    _check_messages(messages)
    template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    extra: dict[str, Any] = {} if tokenizer.chat_template else {"chat_template": DEFAULT_CHAT_TEMPLATE}
    if "tools" in template or "tool_calls" in template:
        plain = [dict(m) for m in messages]
        if tools:
            extra["tools"] = list(tools)
    else:
        plain = _in_plain_roles(messages, tools)
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as error:
        raise ValueError(f"messages do not fit the chat template: {error}") from error
    return text


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


def _in_plain_roles(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[dict]:
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
            content += f'<tool_call>{{"name": {json.dumps(fn.get("name"))}, "arguments": {args}}}</tool_call>'
        out.append({"role": role, "content": content})
    if tools:
        listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        prompt = f"{TOOLS_PROMPT}\n<tools>\n{listed}\n</tools>"
        if out[0]["role"] == "system":
            out[0]["content"] += f"\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
