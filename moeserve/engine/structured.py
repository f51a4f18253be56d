"""Grammar-constrained decoding inside the engine step: masks, matcher advance, jump-forward.

Per-request state is `Sequence.grammar` (a RequestGrammar); this helper holds the per-engine parts
(bitmask buffer, closing tables) and the three moments a step touches the grammar: before the
target runs (`fill_last`, or `cut_and_fill` for drafts), before sampling (`apply`: masks, and near
the end of a request's budget a bias toward closing the output), after sampling (`advance`).

Shapes: B rows, K draft tokens (widest row), P = K + 1 positions, V vocab, W = ceil(V / 32).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from moeserve.grammar import (
    ClosingPolicy,
    CompiledGrammar,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
    bias_toward_closing,
)
from moeserve.grammar.termination import ClosingTables
from moeserve.sequence import Sequence
from moeserve.spec.proposer import Proposal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StructuredConfig:
    """jump_forward: append grammar-forced tokens without sampling them.
    close_margin, close_fraction: in the last max(close_margin, close_fraction * max_tokens)
        tokens of a request's budget (at most half), steer sampling toward the shortest complete
        output; a model that finishes on its own never reaches that tail."""

    jump_forward: bool = True
    close_margin: int = 32
    close_fraction: float = 0.125

    def __post_init__(self) -> None:
        if self.close_margin < 0:
            raise ValueError(f"close_margin must be >= 0, got {self.close_margin}")
        if not 0.0 <= self.close_fraction <= 0.5:
            raise ValueError(f"close_fraction must be in [0, 0.5], got {self.close_fraction}")

    def margin(self, max_tokens: int) -> int:
        """How many of the last tokens of a `max_tokens` budget are steered toward closing."""
        return min(max(self.close_margin, int(self.close_fraction * max_tokens)), max_tokens // 2)


@dataclass
class RequestGrammar:
    """One request's grammar state (`Sequence.grammar`): its matcher and closing-token scorer."""

    matcher: GrammarMatcher
    closing: ClosingPolicy
    next_forced: int | None = None  # resumed inside forced text: the token the next draw must be

    def accept(self, tokens: Seq[int]) -> int:
        n = self.matcher.accept_tokens(tokens)
        self.closing.advance(tokens[:n])
        return n

    def closing_scores_after(self, draft: Seq[int]) -> torch.Tensor:
        """[V] closing scores once `draft` is accepted (the policy itself is left unchanged)."""
        if not draft:
            return self.closing.scores()
        ahead = ClosingPolicy(self.closing.tables, json=self.closing.json)
        ahead.state = self.closing.state
        ahead.advance(draft)
        return ahead.scores()


@dataclass(frozen=True)
class Advance:
    """What the matcher made of a step's tokens."""

    accepted: int  # leading tokens the grammar accepted (all of them unless the engine has a bug)
    finished: bool  # the output is complete and only a stop token may follow
    forced: list[int]  # jump-forward tokens, already accepted by the matcher


class StructuredOutput:
    def __init__(self, vocab_size: int, config: StructuredConfig | None = None) -> None:
        self.vocab_size = vocab_size
        self.cfg = config or StructuredConfig()
        self._bitmask = allocate_bitmask(8, vocab_size)  # [R, W], grown on demand
        self._rows: list[int] = []  # constrained rows filled for the coming apply()
        self._close: list[tuple[int, torch.Tensor]] = []  # (row, closing scores [V]) for rows to steer
        self._tables: ClosingTables | None = None  # per vocabulary, built on first use
        self._stop_row: torch.Tensor | None = None  # [W] only the stop tokens allowed
        self.num_forced_tokens = 0

    # ---- per request -------------------------------------------------------------------------
    def new_request(self, compiled: CompiledGrammar, resume_ids: Seq[int] = ()) -> RequestGrammar:
        """Per-request state for `compiled`, advanced past `resume_ids` (output an earlier attempt
        delivered; ValueError if the grammar refuses it). An attempt cut inside forced text must
        not sample it (another split would shift every later seeded position), so the next draw
        is pinned to the first forced token (`next_forced`) and `advance` forces the rest."""
        if compiled.vocab_size != self.vocab_size:
            raise ValueError(f"grammar was compiled for {compiled.vocab_size} tokens; the model has {self.vocab_size}")
        if self._tables is None:  # a Python pass over the vocabulary, once per engine
            vocab = compiled.grammar.tokenizer_info.decoded_vocab
            self._tables = ClosingTables(vocab, list(compiled.stop_token_ids))
            self._stop_row = allocate_bitmask(1, self.vocab_size)[0].zero_()
            for t in compiled.stop_token_ids:
                self._stop_row[t // 32] |= _bit(t % 32)
        closing = ClosingPolicy(self._tables, json=compiled.spec.kind in ("json_object", "json_schema"))
        state = RequestGrammar(GrammarMatcher(compiled), closing)
        if state.accept(resume_ids) != len(resume_ids):
            raise ValueError("the resumed output does not match the grammar")
        forced = state.matcher.forced_tokens() if resume_ids and self.cfg.jump_forward else []
        state.next_forced = forced[0] if forced else None
        return state

    # ---- 1. bitmask rows ---------------------------------------------------------------------
    def fill_last(self, seqs: Seq[Sequence]) -> bool:
        """One row per sequence (row b = sequence b). False when no sequence is constrained."""
        return self._fill(seqs, None)

    def cut_and_fill(self, seqs: Seq[Sequence], proposals: list[Proposal], limits: Seq[int] | None = None) -> list[Proposal]:
        """Walk each constrained proposal through its matcher, cut it at its first refused token
        (kept when the draft sampled it: its rejection draws from the residual), put in forced text,
        then fill rows b * P + j for j = 0..k (P = 1 + the widest proposal after this); limits[b]:
        most tokens row b keeps. Forced tokens go after the draft token they follow, their mask rows
        allowing only them; the draft goes on after them only if it proposed them itself. Greedy
        output matches plain decoding exactly, sampled output in distribution."""
        walked = list(proposals)
        for b, seq in enumerate(seqs):
            if seq.grammar is not None and walked[b].token_ids:
                walked[b] = self._walk(seq.grammar.matcher, walked[b], None if limits is None else limits[b])
        self._fill(seqs, walked)
        return walked

    def _walk(self, matcher: GrammarMatcher, proposal: Proposal, limit: int | None) -> Proposal:
        """The proposal as verification sees it (`bonus` set where the budget cut forced text off);
        the matcher is left unchanged. Tokens are checked against the mask first (xgrammar warns on refusals)."""
        draft, probs = proposal.token_ids, proposal.probs
        row = self._bitmask[-1:]  # [1, W] scratch, filled again by _fill afterwards
        tokens: list[int] = []
        source: list[int] = []  # the draft position each token came from; -1: forced text
        i = stepped = 0
        while i < len(draft):
            t = int(draft[i])
            matcher.fill_bitmask(row, 0)
            if not (int(row[0, t // 32]) >> (t % 32)) & 1 or not matcher.accept_token(t):
                if probs is not None:  # a sampled refusal stays: the rule rejects it and draws from the residual
                    tokens.append(t)
                    source.append(i)
                break
            stepped += 1
            tokens.append(t)
            source.append(i)
            i += 1
            forced = matcher.forced_tokens() if self.cfg.jump_forward else []
            if not forced:
                continue
            n = matcher.accept_tokens(forced)
            stepped += n
            tokens += forced[:n]
            source += [-1] * n
            if [int(x) for x in draft[i : i + n]] != forced[:n]:
                break  # the draft went another way, or ended: the target's token follows the forced text
            i += n
        matcher.rollback(stepped)
        keep = _cut_at_budget(source, limit)
        bonus = tokens[keep] if keep < len(tokens) and source[keep] < 0 else None
        tokens, source = tokens[:keep], source[:keep]
        if source == list(range(len(draft))):
            return proposal if bonus is None else replace(proposal, bonus=bonus)  # as proposed
        q = None
        if probs is not None:
            q = torch.zeros(len(tokens), probs.shape[-1], dtype=probs.dtype, device=probs.device)  # [k', V]
            for j, (t, src) in enumerate(zip(tokens, source)):
                if src < 0:
                    q[j, t] = 1.0
                else:
                    q[j] = probs[src]
        return Proposal(tokens, q, proposal.predrafted, tuple(j for j, src in enumerate(source) if src < 0), bonus)

    def _fill(self, seqs: Seq[Sequence], proposals: list[Proposal] | None) -> bool:
        self._rows, self._close = [], []
        if all(s.grammar is None for s in seqs):
            return False
        width = 1 if proposals is None else 1 + max(p.num_tokens for p in proposals)
        need = len(seqs) * width
        if self._bitmask.shape[0] < need:
            self._bitmask = allocate_bitmask(max(need, 2 * self._bitmask.shape[0]), self.vocab_size)
        for b, seq in enumerate(seqs):
            if seq.grammar is None:
                continue
            state: RequestGrammar = seq.grammar
            matcher = state.matcher
            row = b * width
            draft = [] if proposals is None else proposals[b].token_ids
            accepted = 0
            if draft:  # all accepted but perhaps the last (a sampled refusal; rows after it: all allowed)
                accepted = matcher.fill_bitmasks_for_draft(draft, self._bitmask, row)
                for j in proposals[b].forced:  # forced text: only its own token
                    self._pin(row + j, draft[j])
                if proposals[b].bonus is not None:  # the budget cut forced text: the bonus is its next token
                    self._pin(row + len(draft), proposals[b].bonus)
            else:
                matcher.fill_bitmask(self._bitmask, row)
                if state.next_forced is not None:
                    self._pin(row, state.next_forced)
            left = seq.params.max_tokens - len(seq.output_ids)
            margin = self.cfg.margin(seq.params.max_tokens)
            for j in range(len(draft) + 1):
                self._rows.append(row + j)
                if j <= accepted and left - j <= margin:
                    self._close.append((row + j, state.closing_scores_after(draft[:j])))
        return True

    def _pin(self, row: int, token: int) -> None:
        """Bitmask row `row` allows `token` only."""
        self._bitmask[row].zero_()
        self._bitmask[row, token // 32] = _bit(token % 32)

    # ---- 2. masking --------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> None:
        """In place: mask the rows filled by the last fill call; logits [B, V] or [B, P, V]."""
        if not self._rows:
            return
        flat = logits.view(-1, logits.shape[-1])  # [B * P, V]
        apply_bitmask(flat, self._bitmask, self._rows)
        for row, scores in self._close:
            bias_toward_closing(flat[row : row + 1], scores)  # views: in place

    # ---- 3. after sampling -------------------------------------------------------------------
    def advance(self, seq: Sequence, tokens: Seq[int]) -> Advance:
        """Accept the emitted tokens; say whether the grammar is done; find forced tokens."""
        state: RequestGrammar = seq.grammar
        matcher = state.matcher
        state.next_forced = None
        accepted = state.accept(tokens)
        if accepted < len(tokens):
            logger.error("request %s: the grammar refused sampled token %d", seq.seq_id, tokens[accepted])
            return Advance(accepted, True, [])
        if self._only_stop_allowed(matcher):
            return Advance(accepted, True, [])
        forced: list[int] = []
        if self.cfg.jump_forward:
            forced = matcher.forced_tokens()
            forced = forced[: state.accept(forced)]
            self.num_forced_tokens += len(forced)
        return Advance(accepted, False, forced)

    def _only_stop_allowed(self, matcher: GrammarMatcher) -> bool:
        if not matcher.is_completed():
            return False
        row = self._bitmask[-1:]  # [1, W] scratch: this step's rows were applied already
        matcher.fill_bitmask(row, 0)
        return bool(torch.equal(row[0], self._stop_row))


def _cut_at_budget(source: Seq[int], limit: int | None) -> int:
    """How many tokens of a walked proposal verification keeps: the first `limit`, whatever they
    are (source[j]: the draft position of token j, -1 for forced text).

    Only a cut by position keeps sampled drafts unbiased: cutting back before forced text that
    crosses the budget would drop a sampled token for its value, and the position's output would
    become q(kept) * (accept or residual) + q(dropped) * p, not p. A cut inside forced text pins
    the bonus position to the next forced token (cut_and_fill), as plain decoding appends it."""
    return len(source) if limit is None else min(len(source), limit)


def _bit(i: int) -> int:
    """Bit i of an int32 bitmask word, as a (signed) int32 value."""
    return 1 << i if i < 31 else -(1 << 31)
