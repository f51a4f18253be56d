"""Proposers: whatever guesses the draft tokens that the target then verifies (once per step, batched).

Shapes: B sequences, K draft tokens (the widest row), k one sequence's draft tokens, V vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from moeserve.sampling_params import SamplingParams


class DraftGrammar(Protocol):
    """What a proposer may do with a request's grammar matcher (moeserve.grammar.GrammarMatcher)."""

    def fill_bitmask(self, bitmask: Tensor, row: int = 0) -> None: ...

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def forced_tokens(self) -> list[int]: ...

    def is_terminated(self) -> bool: ...


@dataclass(frozen=True)
class ProposalRequest:
    """Ask for up to `num_tokens` (0: none) draft tokens continuing `token_ids`.

    token_ids: prompt + accepted tokens; between calls for one seq_id it only grows.
    params: a sampling draft draws q with them; None or greedy: deterministic drafts.
    grammar: the request's matcher, standing at the end of token_ids and left there.
    jump_forward: the engine appends forced text; a deterministic proposal puts it in after the
        draft token it follows and drafts on (num_tokens counts draft tokens only).
    """

    seq_id: str
    token_ids: Sequence[int]
    num_tokens: int
    params: SamplingParams | None = None
    grammar: DraftGrammar | None = None
    jump_forward: bool = False

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence; possibly fewer than asked for (even none).

    probs: [k, V] the distributions the tokens were drawn from; None: deterministic (one-hot q).
    predrafted: drafted ahead while the target verified the step before (a draft deployment's hit).
    forced, bonus (set by the engine): positions of grammar-forced tokens, and the token the bonus
        position must be where the budget cut forced text off (None: the target samples it).
    """

    token_ids: list[int]
    probs: Tensor | None = None  # [k, V]
    predrafted: bool = False
    forced: tuple[int, ...] = ()
    bonus: int | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.token_ids)):
            raise ValueError(f"probs must be [{len(self.token_ids)}, V], got {list(self.probs.shape)}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Proposer(ABC):
    """Guesses draft tokens for a batch of sequences."""

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order; each at most request.num_tokens long."""

    @abstractmethod
    def on_finished(self, seq_id: str) -> None:
        """Frees per-sequence state (index, KV cache); unknown ids are ignored."""


def pad_proposals(proposals: list[Proposal], width: int | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """The rejection sampler's inputs: draft_ids [B, K] (padding 0), draft_probs [B, K, V] or None,
    num_draft [B], with K = width or the longest proposal. draft_probs is None unless some proposal
    carries probabilities; then deterministic rows get one-hot q at their tokens (what None means),
    so mixed batches stay exact. Probabilities stay on the device the draft computed them on."""
    lengths = [p.num_tokens for p in proposals]
    k_max = max(lengths, default=0) if width is None else width
    if any(n > k_max for n in lengths):
        raise ValueError(f"a proposal has {max(lengths)} tokens, more than width {k_max}")
    draft_ids = torch.zeros(len(proposals), k_max, dtype=torch.long)  # [B, K]
    for b, p in enumerate(proposals):
        draft_ids[b, : p.num_tokens] = torch.tensor(p.token_ids, dtype=torch.long)
    num_draft = torch.tensor(lengths, dtype=torch.long)  # [B]
    with_probs = [p.probs for p in proposals if p.probs is not None]
    if not with_probs:
        return draft_ids, None, num_draft
    device = with_probs[0].device
    draft_probs = torch.zeros(len(proposals), k_max, with_probs[0].shape[-1], device=device)  # [B, K, V]
    for b, p in enumerate(proposals):
        if p.probs is not None:
            draft_probs[b, : p.num_tokens] = p.probs.to(device).float()  # [k, V]
        elif p.num_tokens:
            draft_probs[b, torch.arange(p.num_tokens), draft_ids[b, : p.num_tokens]] = 1.0
    return draft_ids.to(device), draft_probs, num_draft.to(device)
