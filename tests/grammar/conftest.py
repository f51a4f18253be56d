"""Shared fixtures: the tiny tokenizer and a compiler whose model vocab is padded past it."""

from __future__ import annotations

import pytest

from bench.tiny_tokenizer import MODEL_VOCAB, build_tiny_tokenizer
from moeserve.config import GrammarSection
from moeserve.grammar import GrammarCompiler


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def compiler(tokenizer):
    # compact JSON, as the cases here are written; the default (spaced) has its own test
    c = GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, config=GrammarSection(json_style="compact").grammar_config())
    yield c
    c.close()
