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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant")

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
) -> str:
    """Render chat messages ({"role": ..., "content": ...}) to the prompt text.

    Roles are "system", "user" and "assistant"; content is a string. Bad messages (and
    templates that reject the conversation) raise ValueError saying which message and
    why. Tokenize the result without adding special tokens: the template has them.
    """
    _check_messages(messages)
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    own_template = {} if tokenizer.chat_template else {"chat_template": DEFAULT_CHAT_TEMPLATE}
    try:
        text = tokenizer.apply_chat_template(
            plain, tokenize=False, add_generation_prompt=add_generation_prompt, **own_template
        )
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
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(message.get('content')).__name__}")
