"""GrammarMatcher: accept, rollback, termination, jump-forward, draft rows, UTF-8 guard."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from moeserve.grammar import GrammarMatcher, GrammarSpec, allocate_bitmask
from moeserve.grammar.utf8 import SECOND_BYTE_RANGE

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def allowed(matcher: GrammarMatcher, bitmask: torch.Tensor, row: int = 0) -> set[int]:
    vocab = matcher.compiled.vocab_size
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


def mask_of(matcher: GrammarMatcher) -> set[int]:
    bitmask = allocate_bitmask(1, matcher.compiled.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return allowed(matcher, bitmask)


@pytest.fixture()
def person(compiler):
    return GrammarMatcher(compiler.compile(GrammarSpec.json_schema(PERSON)))


def test_accept_and_terminate(person, tokenizer):
    ids = tokenizer.encode('{"name":"Ann","age":33}')
    assert person.accept_tokens(ids) == len(ids)
    assert person.is_completed() and not person.is_terminated()
    assert tokenizer.eos_token_id in mask_of(person)
    assert person.accept_token(tokenizer.eos_token_id)
    assert person.is_terminated()
    # terminated: only the stop token is allowed, nothing is accepted any more
    assert mask_of(person) == {tokenizer.eos_token_id}
    assert not person.accept_token(tokenizer.encode("1")[0])
    assert person.forced_tokens() == []


def test_refused_token_leaves_state_unchanged(person, tokenizer):
    ids = tokenizer.encode('{"name":')
    assert person.accept_tokens(ids + tokenizer.encode("12")) == len(ids)  # a number is not a string
    assert person.num_accepted == len(ids)
    assert person.accept_tokens(tokenizer.encode('"x"')) == len(tokenizer.encode('"x"'))


def test_rollback_restores_the_mask(person, tokenizer):
    prefix = tokenizer.encode('{"name":"A')
    person.accept_tokens(prefix)
    before = mask_of(person)
    more = tokenizer.encode('nn","age":3')
    assert person.accept_tokens(more) == len(more)
    assert mask_of(person) != before
    person.rollback(len(more))
    assert mask_of(person) == before and person.num_accepted == len(prefix)
    with pytest.raises(ValueError, match="cannot roll back"):
        person.rollback(len(prefix) + 1)
    person.rollback(len(prefix))
    person.accept_token(tokenizer.eos_token_id)  # refused at the start: JSON must come first
    assert person.num_accepted == 0


def test_rollback_undoes_termination(person, tokenizer):
    person.accept_tokens(tokenizer.encode('{"name":"A","age":1}') + [tokenizer.eos_token_id])
    assert person.is_terminated()
    person.rollback(1)
    assert not person.is_terminated() and person.is_completed()


def test_reset(person, tokenizer):
    start = mask_of(person)
    person.accept_tokens(tokenizer.encode('{"name":"x"'))
    person.reset()
    assert person.num_accepted == 0 and mask_of(person) == start


def test_jump_forward(person, tokenizer, compiler):
    # after "{" the key "name" is forced, and after its value ',"age":' is forced
    forced = person.forced_tokens()
    text = b"".join(compiler.decoded_vocab[t] for t in forced).decode()
    assert '{"name":"'.startswith(text) and len(text) >= 2, text
    assert person.forced_string().startswith(text)
    assert person.num_accepted == 0  # forced_tokens does not accept
    assert person.accept_tokens(forced) == len(forced)
    rest = tokenizer.encode(person.forced_string() + 'Bo"')  # whatever forced text is left, then a value
    assert person.accept_tokens(rest) == len(rest)
    assert person.forced_string() == ',"age":'
    forced = b"".join(compiler.decoded_vocab[t] for t in person.forced_tokens()).decode()
    assert forced and ',"age":'.startswith(forced)  # may stop before `":`, a prefix of the token `":"`


def test_choice_jump_forward_stops_at_ambiguity(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.choice(["sourdough bread", "sourdough rye"])))
    text = b"".join(compiler.decoded_vocab[t] for t in matcher.forced_tokens()).decode()
    assert "sourdough ".startswith(text) and text  # the shared prefix, never past the branch point
    assert matcher.forced_string() == "sourdough "


def test_draft_rows_match_one_step_masks(person, tokenizer):
    prefix = tokenizer.encode('{"name":')
    person.accept_tokens(prefix)
    draft = tokenizer.encode('"Al",')  # the last token is fine; then a refused one
    bad = tokenizer.encode("}")
    k = len(draft) + len(bad) + 1
    bitmask = allocate_bitmask(k + 1, person.compiled.vocab_size)
    accepted = person.fill_bitmasks_for_draft(draft + bad + draft[:1], bitmask, 0)
    assert accepted == len(draft)
    assert person.num_accepted == len(prefix)  # left where it was
    for i in range(len(draft) + 1):  # row i = mask after draft[:i]
        assert allowed(person, bitmask, i) == mask_of(person), i
        if i < len(draft):
            person.accept_token(draft[i])
    assert all(allowed(person, bitmask, i) == set(range(person.compiled.vocab_size)) for i in range(len(draft) + 1, k + 1))


def test_utf8_second_byte_is_range_checked(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.json_schema({"type": "string"})))
    matcher.accept_tokens(tokenizer.encode('"'))
    byte_token = {tokenizer.convert_tokens_to_ids(tok): tok for tok in tokenizer.get_vocab()}
    by_byte = {compiler.decoded_vocab[t]: t for t in byte_token if len(compiler.decoded_vocab[t]) == 1}
    for lead, (lo, hi) in SECOND_BYTE_RANGE.items():
        assert matcher.accept_token(by_byte[bytes([lead])])
        allowed_now = mask_of(matcher)
        firsts = {compiler.decoded_vocab[t][0] for t in allowed_now}
        assert firsts and all(lo <= b <= hi for b in firsts), (hex(lead), sorted(map(hex, firsts)))
        outside = by_byte[bytes([0xBF if lo == 0x80 and hi < 0xBF else 0x80])]
        assert not matcher.accept_token(outside)  # e.g. ED 80..9F only: no surrogates
        assert matcher.accept_token(by_byte[bytes([lo])])
        rest = 2 if lead >= 0xF0 else 1
        assert matcher.accept_tokens([by_byte[b"\x80"]] * rest) == rest
    matcher.accept_tokens(tokenizer.encode('"'))
    assert matcher.is_completed()


def test_bytes_that_never_occur_in_utf8_are_never_allowed(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.regex(".*")))
    raw_bytes = xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab  # before our blanking
    invalid = {t for t, text in enumerate(raw_bytes) if text[:1] in (b"\xc0", b"\xc1", b"\xff")}
    assert invalid and not invalid & mask_of(matcher)
