"""A random "model" decoding under a grammar: the oracle tests' and the conformance bench's driver.

Random logits are the adversary a grammar layer must survive: unlike a trained model they
put mass on every token the mask lets through, so any hole in the mask shows up as invalid
text. The loop is the one the engine runs (mask -> sample -> accept, jump-forward, closing
bias near the budget), minus the model.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from moeserve.grammar import (
    ClosingPolicy,
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
    bias_toward_closing,
)
from moeserve.grammar.termination import ClosingTables


@dataclass
class Decoded:
    token_ids: list[int]  # everything accepted, stop token included
    text: str  # what the client would see: tokenizer.decode without the stop token
    grammar_text: str  # the same bytes as the grammar saw them (decoded vocab), for comparison
    terminated: bool
    utf8_ok: bool = True
    forced: int = 0  # tokens appended by jump-forward
    fill_s: list[float] = field(default_factory=list)
    apply_s: list[float] = field(default_factory=list)


def closing_policy(compiler: GrammarCompiler, compiled: CompiledGrammar) -> ClosingPolicy:
    """A fresh policy steering `compiled`'s output to an end, as the engine's (its tables built once per compiler)."""
    tables = _CLOSING_TABLES.get(compiler)
    if tables is None:  # a Python pass over the vocabulary
        tables = _CLOSING_TABLES[compiler] = ClosingTables(compiler.decoded_vocab, compiler.stop_token_ids)
    return ClosingPolicy(tables, json=compiled.spec.kind in ("json_object", "json_schema"))


_CLOSING_TABLES: weakref.WeakKeyDictionary[GrammarCompiler, ClosingTables] = weakref.WeakKeyDictionary()


def random_decode(
    compiler: GrammarCompiler,
    compiled: CompiledGrammar,
    tokenizer,
    *,
    seed: int,
    budget: int = 48,
    max_tokens: int = 1024,
    jump_forward: bool = True,
    logit_scale: float = 3.0,
) -> Decoded:
    """Sample random logits under the mask; after `budget` tokens steer toward closing."""
    gen = torch.Generator().manual_seed(seed)
    matcher = GrammarMatcher(compiled)
    bitmask = allocate_bitmask(1, compiler.vocab_size)  # [1, W]
    closing = closing_policy(compiler, compiled)
    out = Decoded([], "", "", False)
    while len(out.token_ids) < max_tokens and not matcher.is_terminated():
        if jump_forward:
            forced = matcher.forced_tokens()
            if forced:
                accepted = matcher.accept_tokens(forced)
                assert accepted == len(forced), f"jump-forward token refused: {forced[accepted]}"
                out.token_ids += forced
                closing.advance(forced)
                out.forced += len(forced)
                continue
        t0 = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        t1 = time.perf_counter()
        logits = torch.randn(1, compiler.vocab_size, generator=gen) * logit_scale  # [1, V]
        t2 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        t3 = time.perf_counter()
        out.fill_s.append(t1 - t0)
        out.apply_s.append(t3 - t2)
        if len(out.token_ids) >= budget:
            bias_toward_closing(logits, closing.scores())
        token = int(torch.multinomial(torch.softmax(logits, -1)[0], 1, generator=gen))
        assert matcher.accept_token(token), f"sampled token {token} outside the mask was refused"
        out.token_ids.append(token)
        closing.advance([token])
    out.terminated = matcher.is_terminated()
    stop = set(compiler.stop_token_ids)
    body = [t for t in out.token_ids if t not in stop]
    out.text = tokenizer.decode(body, skip_special_tokens=True)
    # strict: bytes that are not UTF-8 would reach the client as U+FFFD, not what the grammar checked
    out.grammar_text = b"".join(compiler.decoded_vocab[t] for t in body).decode("utf-8", errors="replace")
    out.utf8_ok = _is_utf8(b"".join(compiler.decoded_vocab[t] for t in body))
    return out


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
