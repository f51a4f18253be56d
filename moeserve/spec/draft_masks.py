"""Grammar masks on a draft model's own logits, draft step by draft step.

A draft that sees the request's grammar proposes only tokens the grammar allows (and a sampled
draft's q is masked as the target's p is), instead of proposing tokens the engine then cuts.
Shapes: n rows drafting this step, V the draft's vocabulary, W = ceil(V / 32) bitmask words.
"""

from __future__ import annotations

import torch

from moeserve.grammar.bitmask import allocate_bitmask, apply_bitmask
from moeserve.spec.proposer import DraftGrammar


class GrammarMasks:
    """grammars: each drafting row's matcher (None: unconstrained); vocab: the draft's logits width.
    Before draft j of a constrained row, its matcher accepts draft j - 1 and fills the row's mask,
    applied to the draft's logits (so the argmax, the draw and the sampled q all come from the
    masked distribution); `rollback` returns every matcher to where it stood. A row whose matcher
    refuses a token (the draft stepped past a complete output) goes unmasked: the target refuses
    those drafts anyway.

    A row with `jump_forward` ends after the first draft after which its grammar forces text
    (`forced[b]`: those tokens; the proposer drafts on after them), or after the draft that
    completes its output: `ends[b]` is its proposal's length then, and it is no longer masked.
    """

    def __init__(self, grammars: list[DraftGrammar | None], vocab: int, jump_forward: list[bool] | None = None) -> None:
        # a grammar over another vocabulary size (a draft with a padded head) cannot mask these logits
        self.rows = [b for b, g in enumerate(grammars) if g is not None and _vocab_of(g, vocab) == vocab]
        self.grammars = [grammars[b] for b in self.rows]
        self.jump_forward = [bool(jump_forward and jump_forward[b]) for b in self.rows]
        self.accepted = [0] * len(self.rows)
        self.live = [True] * len(self.rows)
        self.ends: dict[int, int] = {}
        self.forced: dict[int, list[int]] = {}
        self.bitmask = allocate_bitmask(len(grammars), vocab) if self.rows else None  # row b: drafting row b

    def apply(self, logits: torch.Tensor, out: torch.Tensor, j: int) -> None:
        """Masks draft j's logits [n, V] in place for the constrained rows among the first n; out [B, K]:
        the drafts so far (draft j - 1 is what each matcher accepts first)."""
        masked = []
        for i, (b, g) in enumerate(zip(self.rows, self.grammars)):
            if b >= logits.shape[0] or not self.live[i]:
                continue
            if j:
                if not g.accept_token(int(out[b, j - 1])):
                    self.live[i] = False
                    continue
                self.accepted[i] += 1
                if self._ends_after(i, b, j - 1):
                    continue
            g.fill_bitmask(self.bitmask, b)
            masked.append(b)
        if masked:
            apply_bitmask(logits, self.bitmask, masked)

    def _ends_after(self, i: int, b: int, pos: int) -> bool:
        """Whether row b (the i-th constrained row) ends after draft `pos`, which its matcher just
        accepted: after its stop token, or where the grammar forces text."""
        g = self.grammars[i]
        if not self.jump_forward[i]:
            return False
        if not g.is_terminated():
            forced = g.forced_tokens()
            if not forced:
                return False
            self.forced[b] = forced
        self.ends[b] = pos + 1
        self.live[i] = False
        return True

    def all_ended(self, n: int) -> bool:
        """Whether each of the first n rows has ended (at forced text, or after its stop token)."""
        return all(b in self.ends for b in range(n))

    def rollback(self) -> None:
        for g, n in zip(self.grammars, self.accepted):
            g.rollback(n)


def _vocab_of(grammar: DraftGrammar, default: int) -> int:
    compiled = getattr(grammar, "compiled", None)
    return getattr(compiled, "vocab_size", default)
