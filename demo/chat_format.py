"""The demo chat format: five special tokens and the Jinja template that renders a conversation.

A conversation renders as ``<|role|>\\ncontent<|end|>\\n`` per message; a training document
ends with ``<|endoftext|>``. Generation stops at ``<|end|>`` (end of the assistant's turn)
or ``<|endoftext|>`` (end of a document), so both are listed as EOS in generation_config.json.
"""

from __future__ import annotations

EOS = "<|endoftext|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS, SYSTEM, USER, ASSISTANT, END)  # EOS first: token id 0

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render messages exactly as CHAT_TEMPLATE does (no Jinja needed to build the corpus)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}{END}\n" for m in messages)
    return text + (f"{ASSISTANT}\n" if add_generation_prompt else "")
