"""Shared fixtures: the tiny tokenizer and a compiler whose model vocab is padded past it."""

from __future__ import annotations

import pytest

from moeserve.grammar import GrammarCompiler
from tests.grammar.tiny_tokenizer import MODEL_VOCAB, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB)
    yield c
    c.close()
