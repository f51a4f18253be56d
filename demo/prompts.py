"""Benchmark prompts: formulaic (held-out demo-corpus chats) and free-form (off-domain asks).

Formulaic prompts are the held-out split of demo/corpus.py, cut before the last assistant
turn: the reply is what the demo pair was trained to write, so a draft agrees often.
Free-form prompts ask for things the corpus never contains.
"""

from __future__ import annotations

from demo.corpus import iter_documents
from moeserve.tokenizer import render_chat

FREE_FORM = (
    "Write a short poem about the monsoon over the Western Ghats.",
    "Explain how a transistor works to a ten-year-old.",
    "What were the main causes of the French Revolution?",
    "Translate 'the train leaves at seven' into German and Spanish.",
    "Give me three ideas for a science fair project about magnets.",
    "Why is the sky blue during the day and red at sunset?",
    "Summarise the plot of Hamlet in two sentences.",
    "How do I reverse a linked list in Python?",
    "What is the difference between weather and climate?",
    "Suggest a name for a black cat that likes to sleep in boxes.",
    "List four planets and one fact about each.",
    "Describe a quiet morning in a mountain village.",
)


def formulaic(tokenizer, n: int, skip: int = 100) -> list[list[int]]:
    """n held-out chat prompts (token ids), after skipping the first `skip` chats (which the
    training report's agreement measure used)."""
    out: list[list[int]] = []
    seen = 0
    for sample in iter_documents("heldout"):
        if sample.messages is None:
            continue
        seen += 1
        if seen <= skip:
            continue
        out.append(_encode(tokenizer, sample.messages[:-1]))
        if len(out) == n:
            return out
    raise AssertionError("unreachable: the document stream is endless")


def free_form(tokenizer, n: int) -> list[list[int]]:
    """n off-domain user requests rendered with the chat template (token ids)."""
    return [_encode(tokenizer, [{"role": "user", "content": FREE_FORM[i % len(FREE_FORM)]}]) for i in range(n)]


def _encode(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
