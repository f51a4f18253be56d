"""What crosses a process boundary on the way to the engine core and back: small frozen, picklable
dataclasses (no tensors, no tokenizer, no compiled grammar).

One request is one stream: a `GenerateRequest` in, `GenerateChunk`s of new token ids out until one
is `finished`; the core sends one list of chunks per step. Errors travel in-band: a chunk with
`error` set ends its stream. `paced` and `hand_over`: how a stream's chunks reach its reader.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from moeserve.errors import ErrorCode
from moeserve.grammar.spec import GrammarSpec
from moeserve.sampling_params import SamplingParams, TokenLogprob, TokenTrace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamError:
    code: ErrorCode
    message: str
    param: str | None = None  # the request field at fault ("grammar": whichever field carried it)
    retryable: bool = True  # False: a fresh attempt would fail the same way (the core isolated the cause)


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request, already tokenized and validated. timeout_s: the engine aborts it with
    DEADLINE_EXCEEDED this long after receiving it. resume_ids: output an earlier attempt already
    streamed, which the engine continues after (one unbroken stream after a replica or shard dies)."""

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
    """New output of one request since its previous chunk; `usage` holds running totals."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    error: StreamError | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when the request asked for them
    trace: tuple[TokenTrace, ...] | None = None  # one per token id, when the request asked for a trace

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def with_text(self, text: str) -> GenerateChunk:
        """This chunk with `text` (what dataclasses.replace does, without its per-call field lookups:
        the gateway makes one per streamed chunk)."""
        return GenerateChunk(self.request_id, self.token_ids, text, self.finish_reason, self.usage, self.error,
                             self.logprobs, self.trace)

    def merge(self, later: GenerateChunk) -> GenerateChunk:
        """This chunk followed by `later` as one chunk (coalescing a backlog into one message)."""
        return GenerateChunk(self.request_id, self.token_ids + later.token_ids, self.text + later.text,
                             later.finish_reason, later.usage, later.error, _join(self.logprobs, later.logprobs),
                             _join(self.trace, later.trace))


def error_chunk(request_id: str, code: ErrorCode, message: str, usage: Usage | None = None,
                token_ids: tuple[int, ...] = (), param: str | None = None, retryable: bool = True) -> GenerateChunk:
    """The final chunk of a stream that ended in an error (after `token_ids`, if any)."""
    return GenerateChunk(request_id, token_ids, finish_reason="error", usage=usage or Usage(),
                         error=StreamError(code, message, param, retryable))


# ---- between an engine replica and its core -------------------------------------------------------
@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class StatsRequest:
    token: int


@dataclass(frozen=True)
class StatsReply:
    token: int
    stats: dict


@dataclass(frozen=True)
class ApplyPlacement:
    """Move the shard group's experts to this placement between two steps (live re-placement)."""

    rank_experts: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Resize:
    """Take the shard group to this many ranks, one rank at a time between steps (elastic width)."""

    width: int


def _join(a: tuple | None, b: tuple | None) -> tuple | None:
    """Per-token entries of two consecutive chunks (None when neither has any)."""
    return None if a is None and b is None else (a or ()) + (b or ())


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class CoreReady:
    """The core process has loaded its model and reads requests."""

    pid: int
    max_num_seqs: int


@dataclass(frozen=True)
class CoreStopped:
    """The core's last message: its loop ended (every live request already got an error chunk)."""

    reason: str


@dataclass(frozen=True)
class DraftCall:
    """One engine step's request to a draft worker: every drafting sequence of the step, and the
    sequences that ended since the last call; answered by a list of `Proposal`s, one per request."""

    requests: list  # [ProposalRequest] (moeserve/spec/proposer.py, which imports this package)
    finished: list[str] = field(default_factory=list)


async def paced(chunk: GenerateChunk, chunks: asyncio.Queue, interval: float, first: bool) -> GenerateChunk:
    """A stream's next message from `chunk` and its queue: after the first message, up to `interval`
    seconds' wait (fewer, larger messages under load), ended by the stream's last chunk, with what
    arrives coalesced into it (never into the first: time to first token). The engine replica's
    streams and the direct ones pace alike."""
    if first or chunk.finished:
        return chunk
    if interval:
        try:
            async with asyncio.timeout(interval):
                while not chunk.finished:
                    chunk = chunk.merge(await chunks.get())
        except TimeoutError:
            pass
    while not chunk.finished and not chunks.empty():
        chunk = chunk.merge(chunks.get_nowait())
    return chunk


def hand_over(items: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]]) -> None:
    """Put each item in its asyncio queue from another thread: one thread-safe call per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for loop, queue, item in items:
        by_loop.setdefault(loop, []).append((queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed: nobody reads these any more
            logger.warning("dropping %d items for a closed event loop", len(batch))


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
