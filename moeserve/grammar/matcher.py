"""Per-request grammar state: `GrammarMatcher`, the request-level half of vLLM v1's split.

Per decode step: `fill_bitmask` (what may come next), sample under the mask, `accept_token`, then
`forced_tokens` (jump-forward). Once the output is complete the mask also allows the stop tokens;
once one is accepted, only them.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.torch
import torch
import xgrammar as xgr

from moeserve.grammar.compiler import CompiledGrammar
from moeserve.grammar.utf8 import pending_lead


class GrammarMatcher:
    """Tracks one output against one compiled grammar; cheap to create (one per request)."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.grammar) if compiled.grammar is not None else _LLGuidance(compiled)
        self._vocab = compiled.vocab
        self._history: list[int] = []  # accepted since reset: what rollback() can undo

    @property
    def num_accepted(self) -> int:
        return len(self._history)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar refuses it."""
        token_id = int(token_id)
        if self._matcher.is_terminated() or not 0 <= token_id < self.compiled.vocab_size:
            return False
        lead = self._pending_lead()
        if lead is not None and not self._vocab.second_byte_rows[lead][token_id // 32] >> (token_id % 32) & 1:
            return False
        if not self._matcher.accept_token(token_id):
            return False
        self._history.append(token_id)
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Accept tokens in order up to the first refused one; returns how many were accepted."""
        for n, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                return n
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. rejected draft tokens)."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self._history)} were accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._history[-num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32, from `allocate_bitmask`)."""
        if self._matcher.is_terminated():
            bitmask[row].copy_(self._vocab.stop_row)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        lead = self._pending_lead()
        if lead is not None:
            bitmask[row] &= self._vocab.second_byte_rows[lead]

    def fill_bitmasks_for_draft(self, draft_token_ids: Sequence[int], bitmask: torch.Tensor, row: int = 0) -> int:
        """Rows row..row+k for verifying k draft tokens (row+i: after draft[:i]), leaving the
        matcher where it was. Returns how many leading draft tokens the grammar accepts; rows past
        the first refused one stay all-allowed, since the verifier rejects that token and never reaches them."""
        accepted = 0
        for i, token_id in enumerate(draft_token_ids):
            self.fill_bitmask(bitmask, row + i)
            allowed = (int(bitmask[row + i, token_id // 32]) >> (token_id % 32)) & 1  # xgrammar warns on refusals
            if not allowed or not self.accept_token(token_id):
                bitmask[row + i + 1 : row + len(draft_token_ids) + 1].fill_(-1)
                break
            accepted += 1
        else:
            self.fill_bitmask(bitmask, row + len(draft_token_ids))
        self.rollback(accepted)
        return accepted

    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is finished."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """What was accepted so far is a complete output (a stop token would be allowed now)."""
        return self._matcher.is_terminated() or self._matcher.is_completed()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward), without accepting them: the forced text
        (`"name":"` after `{` in a one-key schema) split greedily into vocabulary tokens. It stops
        before a partial UTF-8 character and leaves out a last token that prefixes a longer one
        (`"na` when `"name` exists), so it may return [] although something is forced."""
        if self._matcher.is_terminated():
            return []
        return self._matcher.find_jump_forward_tokens()

    def forced_string(self) -> str:
        """The forced continuation as text (may be longer than `forced_tokens` covers)."""
        return "" if self._matcher.is_terminated() else self._matcher.find_jump_forward_string()

    def reset(self) -> None:
        self._matcher.reset()
        self._history.clear()

    def _pending_lead(self) -> int | None:
        """A UTF-8 lead byte at the end of the output whose next byte has a narrowed range (utf8.py)."""
        for token_id in reversed(self._history):
            text = self._vocab.decoded_vocab[token_id]
            if text:
                return pending_lead(text)
        return None


class _LLGuidance:
    """llguidance's matcher behind the xgrammar matcher calls `GrammarMatcher` makes. A refused
    token leaves it unchanged (llguidance itself would enter an error state for good)."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self._m = llguidance.LLMatcher(compiled.llg_tokenizer, compiled.source, log_level=0)
        self._stop = frozenset(compiled.stop_token_ids)
        self._terminated = False  # a stop token was accepted

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stop:  # kept here, not in llguidance: rollback past it stays simple
            self._terminated = self._m.is_accepting()
            return self._terminated
        if self._m.is_stopped() or self._m.validate_tokens([token_id]) != 1:
            return False
        return self._m.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated, num_tokens = False, num_tokens - 1
        if num_tokens:
            self._m.rollback(num_tokens)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return self._m.is_accepting()

    def find_jump_forward_tokens(self) -> list[int]:
        return self._m.compute_ff_tokens()

    def find_jump_forward_string(self) -> str:
        return self._m.compute_ff_bytes().decode("utf-8", errors="ignore")

    def reset(self) -> None:
        self._m.reset()
        self._terminated = False
