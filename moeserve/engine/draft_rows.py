"""What the draft model (draft_model.py) holds per sequence, and the rows of one drafting step.

Shapes: B rows drafting this step (sorted by k, longest first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeserve.sampling_params import SamplingParams
from moeserve.spec.proposer import DraftGrammar


@dataclass
class DraftSeq:
    """What the draft holds for one sequence: the tokens whose keys/values are in its cache."""

    cached: list[int] = field(default_factory=list)
    seen: int = 0  # length of the last request's token ids: a prefix the engine never rewrites
    last_used: int = 0


@dataclass
class DraftRow:
    """One sequence drafting this step."""

    index: int  # position in the request list
    seq_id: str
    tokens: list[int]  # the request's token ids
    k: int
    start: int  # tokens of `tokens` already in the draft cache (after rollback)
    params: SamplingParams | None  # None: propose the argmax
    grammar: DraftGrammar | None = None  # masks the draft's own distribution at each draft step
    jump_forward: bool = False  # ProposalRequest.jump_forward: drafts through forced text


@dataclass(frozen=True)
class DraftBatch:
    """The drafting rows' block tables and lengths as tensors, built once per step."""

    tables: torch.Tensor  # [B, nb] each row's blocks, covering its tail and the drafts it feeds
    lengths: torch.Tensor  # [B] tokens cached once caught up


def common_prefix(cached: list[int], tokens: list[int], hint: int) -> int:
    """Length of the common prefix: up to `hint` (the last request's length) in one comparison,
    then token by token."""
    limit = min(len(cached), len(tokens))
    n = min(hint, limit)
    if cached[:n] != tokens[:n]:
        n = 0  # a rewritten history: compare from the start
    while n < limit and cached[n] == tokens[n]:
        n += 1
    return n
