"""Closing scores: the JSON lexer state decides what a token closes."""

from __future__ import annotations

import torch

from bench.grammar_decoding import closing_policy
from moeserve.grammar import GrammarSpec, bias_toward_closing
from moeserve.grammar.termination import OUT, STOP_SCORE, STR, ClosingPolicy, ClosingTables

VOCAB = [b"<eos>", b'"}', b"}", b",", b'},{"', b"a", b"abc", b"\\", b'"', b"{"]


def test_scores_follow_the_lexer_state():
    tables = ClosingTables(VOCAB, [0])
    s_out, s_str = tables.scores[OUT], tables.scores[STR]
    assert s_out[0] == s_str[0] == STOP_SCORE
    assert s_str[1] == 2.0  # closes the string and the object
    assert s_out[1] == -1.0  # outside a string: opens a string (the brace is inside it)
    assert s_out[2] == 1.0 and s_out[3] == 0.5 and s_out[4] == -1.5 and s_out[9] == -1.0
    assert s_str[5] == 0.5 and s_str[6] == 0.0  # single-byte bonus inside strings only
    policy = ClosingPolicy(tables)
    policy.advance([8, 5, 7])  # '"', 'a', backslash: inside a string, after an escape
    assert policy.state != OUT
    policy.advance([8])  # the escaped quote does not close the string
    assert policy.state == STR
    policy.advance([8])
    assert policy.state == OUT


def test_bias_never_unmasks():
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    bias_toward_closing(logits, torch.tensor([STOP_SCORE, STOP_SCORE, -1.0]))
    assert logits[0, 1] == float("-inf") and logits[0, 0] > logits[0, 2]


def test_policy_kind_follows_the_grammar(compiler):
    assert closing_policy(compiler, compiler.compile(GrammarSpec.json_object())).json
    plain = closing_policy(compiler, compiler.compile(GrammarSpec.regex("a+")))
    assert not plain.json and float(plain.scores().max()) == STOP_SCORE
