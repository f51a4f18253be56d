"""Incremental detokenization: token ids in, finished text out, with stop strings.

Two things make streaming text harder than `tokenizer.decode(all_ids)`:

1. Byte-level BPE splits multi-byte UTF-8 characters across tokens ("₹" is three bytes
   and may be two or three tokens). Decoding a prefix that ends inside a character
   yields U+FFFD, which must never reach the client. We keep two offsets into the
   token ids, as vLLM does: text is final up to `read`; each push decodes only the
   window from `prefix` (the previous `read`) to the end, and emits the part past the
   prefix text once the window no longer ends in U+FFFD. Each push costs O(window),
   not O(everything generated).
2. Stop strings: text that could be the start of a stop string is held back until it
   either completes the stop string (then it and everything after are dropped, as the
   OpenAI API does) or cannot anymore.

Invariant (tested against full decodes): the concatenation of everything `push` and
`finish` return equals `tokenizer.decode(generated, skip_special_tokens=...)` for
byte-level tokenizers, cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded with the first window, so that decoders whose output depends on
# the previous token (SentencePiece's leading space) render the first generated token as
# it reads after the prompt. vLLM uses the same number.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request streaming decoder.

    Args:
        tokenizer: a transformers tokenizer (fast ones are decoded through their Rust
            backend directly).
        prompt_ids: the prompt's token ids; only the last few are used as context.
        stop: stop strings; the output ends just before the first one to complete.
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.

    Use: `push(new_ids)` after each step returns the newly final text; `stopped`
    turns true once a stop string completed (stop generating then); `finish()` returns
    whatever was held back.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
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
    """The cheapest faithful decode: the Rust backend when there is one.

    No clean-up of tokenization spaces: it rewrites text across window boundaries, and
    modern tokenizers turn it off anyway (vLLM does not apply it either).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
