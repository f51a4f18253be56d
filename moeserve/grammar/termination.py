"""Ending a constrained output on time: steer toward closing what is open.

A grammar guarantees every *finished* output is valid, not that the model finishes: a weak model
inside `{"a": [` can add items until `max_tokens`, and a cut-off JSON document is invalid. Near the
end of its budget the sampler adds `CLOSING_BOOST * policy.scores()` to the masked logits, so among
the allowed tokens the one that closes most wins (ties keep the model's preference).

A token's score is how many JSON levels it closes, from a tiny lexer run over its bytes (`"}`
inside a string closes two); a lone comma ends a number that could grow forever (COMMA_BONUS).
Masked logits stay -inf, so this never admits a refused token; it is greedy, not a proof.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

STOP_SCORE = 1000.0  # the stop token wins whenever the grammar allows it (the output is complete)
CLOSING_BOOST = 1.0e4  # dwarfs any real logit gap, so the score decides and logits break ties
SINGLE_BYTE_BONUS = 0.5  # inside strings short steps explore a `pattern` fastest; below one level, so closing wins
COMMA_BONUS = 0.5  # outside strings: a lone comma +0.5, a comma in a longer token (one more member) -0.5

OUT, STR, ESC = 0, 1, 2  # lexer states: outside strings, inside a string, after a backslash


def _lex(state: int, data: bytes) -> tuple[float, int]:
    """(levels closed minus opened plus the comma term, final lexer state) after `data`."""
    depth, commas = 0, 0
    for b in data:
        if state == ESC:
            state = STR
        elif state == STR:
            if b == 0x5C:  # backslash
                state = ESC
            elif b == 0x22:  # closing quote
                state, depth = OUT, depth - 1
        elif b == 0x22:
            state, depth = STR, depth + 1
        elif b in b"{[":
            depth += 1
        elif b in b"}]":
            depth -= 1
        elif b == 0x2C:  # comma
            commas += 1
    return -depth + COMMA_BONUS * (commas if data == b"," else -commas), state


class ClosingTables:
    """Per vocabulary: for each lexer state, each token's score and the state it leads to."""

    def __init__(self, decoded_vocab: Sequence[bytes], stop_token_ids: Sequence[int]) -> None:
        self.scores = torch.zeros(3, len(decoded_vocab))  # [3, V]
        self.next_state = [[OUT] * len(decoded_vocab) for _ in range(3)]  # [3][V]
        for state in (OUT, STR, ESC):
            for t, text in enumerate(decoded_vocab):
                score, after = _lex(state, text)
                self.scores[state, t] = score + (SINGLE_BYTE_BONUS if state != OUT and len(text) == 1 else 0.0)
                self.next_state[state][t] = after
        self.scores[:, list(stop_token_ids)] = STOP_SCORE
        # Non-JSON grammars: nothing to close; short steps explore a regex's alphabet fastest.
        self.plain = torch.tensor([SINGLE_BYTE_BONUS if len(t) == 1 else 0.0 for t in decoded_vocab])  # [V]
        self.plain[list(stop_token_ids)] = STOP_SCORE


class ClosingPolicy:
    """Per request: follows the output's lexer state; `scores()` is the closing preference now."""

    def __init__(self, tables: ClosingTables, *, json: bool = True) -> None:
        self.tables = tables
        self.json = json
        self.state = OUT

    def advance(self, token_ids: Iterable[int]) -> None:
        """Feed every accepted token (sampled or forced), in order."""
        for t in token_ids:
            self.state = self.tables.next_state[self.state][t]

    def scores(self) -> torch.Tensor:
        """[V] float32."""
        return self.tables.scores[self.state] if self.json else self.tables.plain


def bias_toward_closing(logits: torch.Tensor, scores: torch.Tensor, boost: float = CLOSING_BOOST) -> None:
    """In place: logits [B, V] += boost * scores [V]. Apply after the grammar mask."""
    logits.add_(scores.to(logits.device, logits.dtype), alpha=boost)
