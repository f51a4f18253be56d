"""Per-request state inside the engine, and what the engine reports back each step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moeserve.sampling_params import SamplingParams, TokenLogprob, TokenTrace


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's list.remove must not compare every field
class Sequence:
    """One request being generated. `num_cached` counts tokens whose keys/values are in the KV
    cache; in decode that is every token but the last sampled one, which the next step feeds."""

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    grammar: object | None = None  # per-request grammar matcher, when the request is constrained

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def pending_ids(self) -> list[int]:
        """Tokens the next forward pass must feed (the uncached tail)."""
        return self.token_ids[self.num_cached :]


@dataclass
class RequestOutput:
    """What one step produced for one request: its new token ids, and whether it ended.
    The engine is token-in, token-out: text and stop strings are the serving side's."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # why it ended with finish_reason "error"
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    trace: list[TokenTrace] | None = None  # one per new token, when the request asked for a trace
