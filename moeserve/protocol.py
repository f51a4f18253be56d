"""What crosses the process boundary between the gateway and the engine replica.

One request is one streaming call: the gateway sends a `GenerateRequest` and receives
`GenerateChunk`s until one has `finished` set. Everything here is a small frozen,
picklable dataclass; no tensors, no tokenizer, no compiled grammar.

Which side compiles the grammar: both, from the same `GrammarSpec`. The gateway compiles
first, so an invalid schema, regex or EBNF is a 400 before the request costs the engine
anything, and so it has a matcher of its own to guard the stream. The engine compiles
again from its own cache (~0.1 ms on a hit) rather than receiving the compiled grammar:
a compiled grammar carries per-state token masks (megabytes for a 32k vocabulary), while
the spec is a few hundred bytes, and the engine's cache hits on every repeated schema.

Errors travel in-band: a chunk with `error` set is the last chunk of its stream. Its
`code` uses gRPC's vocabulary so both front ends can map it (HTTP status in the gateway).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moeserve.grammar.spec import GrammarSpec
from moeserve.sampling_params import SamplingParams


class ErrorCode(str, enum.Enum):
    """Why a stream ended without a normal finish; names follow gRPC status codes."""

    INVALID_ARGUMENT = "invalid_argument"  # the request itself is bad (HTTP 400)
    RESOURCE_EXHAUSTED = "resource_exhausted"  # engine queue full: retry later (HTTP 503 + Retry-After)
    UNAVAILABLE = "unavailable"  # engine stopped or failed (HTTP 503)
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request's timeout passed (HTTP 504)
    INTERNAL = "internal"  # a bug or an engine step error (HTTP 500)


@dataclass(frozen=True)
class StreamError:
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request, already tokenized and validated by the gateway.

    timeout_s: the engine aborts the request with DEADLINE_EXCEEDED this long after it
        receives it (None: no limit). The gateway keeps its own overall limit as well.
    resume_ids: output tokens an earlier attempt already streamed to the client; when a
        replica or shard dies mid-stream the gateway resubmits with them and the engine
        continues after them, so the client sees one uninterrupted stream.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    grammar: GrammarSpec | None = None
    timeout_s: float | None = None
    resume_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "resume_ids", tuple(int(t) for t in self.resume_ids))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerateChunk:
    """New output of one request since its previous chunk.

    finish_reason: None while running; then "stop", "length", "abort" or "error".
    usage: running totals, so the last chunk carries the final counts.
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    error: StreamError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: GenerateChunk) -> GenerateChunk:
        """This chunk followed by `later` as one chunk (coalescing a backlog into one message)."""
        return GenerateChunk(
            self.request_id,
            self.token_ids + later.token_ids,
            self.text + later.text,
            later.finish_reason,
            later.usage,
            later.error,
        )


def error_chunk(request_id: str, code: ErrorCode, message: str, usage: Usage | None = None) -> GenerateChunk:
    """The final chunk of a stream that ended in an error."""
    return GenerateChunk(request_id, finish_reason="error", usage=usage or Usage(), error=StreamError(code, message))
