"""GrammarCompiler: caching, limits, error messages, vocabulary handling."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import pytest
import torch

from bench.tiny_tokenizer import MODEL_VOCAB
from moeserve.config import GrammarSection
from moeserve.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    GrammarTimeoutError,
    allocate_bitmask,
)

DEFAULTS = GrammarSection().grammar_config()  # the config tree's
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}


def allowed_ids(matcher: GrammarMatcher, vocab: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


def test_second_compile_is_a_fast_cache_hit(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, config=DEFAULTS)
    spec = GrammarSpec.json_schema(SCHEMA)
    t0 = time.perf_counter()
    first = compiler.compile(spec)
    t1 = time.perf_counter()
    second = compiler.compile(GrammarSpec.json_schema(dict(SCHEMA)))  # an equal spec, a new object
    t2 = time.perf_counter()
    assert second is first
    assert compiler.cache_info()["hits"] == 1 and compiler.cache_info()["misses"] == 1
    assert t2 - t1 < max(0.005, (t1 - t0) / 5), (t1 - t0, t2 - t1)
    compiler.close()


def test_errors_are_cached_too(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, config=DEFAULTS)
    spec = GrammarSpec.regex("(unclosed")
    for _ in range(2):
        with pytest.raises(GrammarError, match="invalid regex"):
            compiler.compile(spec)
    assert compiler.cache_info()["misses"] == 1
    compiler.close()


def test_lru_is_bounded(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, config=replace(DEFAULTS, cache_size=2))
    specs = [GrammarSpec.regex(f"a{{{n}}}") for n in range(1, 4)]
    for spec in specs:
        compiler.compile(spec)
    compiler.compile(specs[0])  # evicted: compiled again
    assert compiler.cache_info() | {"bytes": 0} == {"hits": 0, "misses": 4, "size": 2, "bytes": 0, "in_flight": 0}
    compiler.compile(specs[0])
    assert compiler.cache_info()["hits"] == 1
    compiler.close()


def test_concurrent_requests_for_one_spec_compile_once(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, config=DEFAULTS)
    spec = GrammarSpec.regex("[a-z]{1,300}")
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    assert compiler.cache_info()["misses"] == 1
    compiler.close()


def test_time_limit(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, config=replace(DEFAULTS, compile_timeout_s=0.05))
    spec = GrammarSpec.json_schema({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 64} for i in range(12)}})
    release, compile_now = threading.Event(), compiler._compile_now

    def slow_compile(s):  # a compile that outlasts the limit however fast the machine is
        release.wait(30)
        return compile_now(s)

    compiler._compile_now = slow_compile
    with pytest.raises(GrammarTimeoutError, match="took longer than") as info:
        compiler.compile(spec)
    assert info.value.feature == "timeout"
    release.set()
    deadline = time.time() + 30  # the job finishes in the background and is cached for the retry
    while compiler.cache_info()["in_flight"] and time.time() < deadline:
        time.sleep(0.01)
    assert compiler.compile(spec).spec == spec
    compiler.close()


def test_size_limit(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, config=replace(DEFAULTS, max_spec_chars=100))
    with pytest.raises(GrammarError, match="limit is 100") as info:
        compiler.compile(GrammarSpec.regex("a" * 101))
    assert info.value.feature == "size"
    compiler.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec.regex("(a"), "invalid regex"),
        (GrammarSpec.regex("a{3,1}"), "invalid regex"),
        (GrammarSpec.ebnf('root ::= "a" undefined_rule'), "invalid ebnf"),
        (GrammarSpec.ebnf("root ::= "), "invalid ebnf"),
        (GrammarSpec.ebnf('start ::= "a"'), "invalid ebnf"),  # no root rule
    ],
)
def test_bad_grammars_carry_xgrammars_message(compiler, spec, message):
    with pytest.raises(GrammarError, match=message) as info:
        compiler.compile(spec)
    assert "/project/cpp" not in info.value.message  # the C++ log prefix is stripped
    assert len(info.value.message) > len(message) + 5  # and the reason itself is kept


def test_config_is_validated():
    with pytest.raises(ValueError, match="cache_size"):
        replace(DEFAULTS, cache_size=0)
    with pytest.raises(ValueError, match="compile_timeout_s"):
        replace(DEFAULTS, compile_timeout_s=0)
    with pytest.raises(ValueError, match="separators"):
        replace(DEFAULTS, separators=(";", "="))


def test_json_is_written_in_the_configured_style(tokenizer):
    schema = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                                      "required": ["a", "b"], "additionalProperties": False})
    for config, good, bad in ((DEFAULTS, '{"a": 1, "b": "x"}', '{"a":1,"b":"x"}'),
                              (GrammarSection(json_style="compact").grammar_config(), '{"a":1,"b":"x"}', '{"a": 1, "b": "x"}')):
        compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, config=config)
        for text, ok in ((good, True), (bad, False)):
            matcher = GrammarMatcher(compiler.compile(schema))
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert (matcher.accept_tokens(ids) == len(ids) and matcher.is_completed()) is ok, (config.separators, text)
        compiler.close()


def test_vocab_padding_and_special_tokens_never_allowed(compiler, tokenizer):
    assert compiler.vocab_size == MODEL_VOCAB > len(tokenizer)
    for spec in (GrammarSpec.json_schema({"type": "string"}), GrammarSpec.regex(".*")):
        matcher = GrammarMatcher(compiler.compile(spec))
        if spec.kind == "json_schema":
            matcher.accept_tokens(tokenizer.encode('"'))
        allowed = allowed_ids(matcher, compiler.vocab_size)
        assert not allowed & set(range(len(tokenizer), MODEL_VOCAB)), "padding ids allowed"
        assert tokenizer.pad_token_id not in allowed, "<|pad|> allowed as text"
        assert not matcher.accept_token(MODEL_VOCAB - 1) and not matcher.accept_token(MODEL_VOCAB + 5)


def test_json_grammars_never_allow_control_bytes(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.json_schema({"type": "string", "minLength": 1})))
    assert matcher.accept_tokens(tokenizer.encode('"a')) == len(tokenizer.encode('"a'))
    allowed = allowed_ids(matcher, compiler.vocab_size)
    assert all(not any(b < 0x20 for b in compiler.decoded_vocab[t]) for t in allowed)
    newline = tokenizer.convert_tokens_to_ids("Ċ")  # byte-level BPE's "\n"
    assert not matcher.accept_token(newline)


def test_regex_grammars_may_use_newlines(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.regex("a\nb")))
    assert matcher.accept_tokens([tokenizer.convert_tokens_to_ids(t) for t in ("a", "Ċ", "b")]) == 3
    assert matcher.is_completed()


def test_custom_stop_tokens(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, config=DEFAULTS, stop_token_ids=[tokenizer.pad_token_id])
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.choice(["yes"])))
    matcher.accept_tokens(tokenizer.encode("yes"))
    assert not matcher.accept_token(tokenizer.eos_token_id)
    assert matcher.accept_token(tokenizer.pad_token_id) and matcher.is_terminated()
    compiler.close()


def test_an_overlapping_oneof_is_refused_unless_asked_to_run_as_anyof(tokenizer):
    """grammar.one_of: "exact" (default) refuses a oneOf no branch of which excludes the other;
    "as_any_of" generates its branches as anyOf (documented: an output may match both)."""
    import jsonschema

    from moeserve.grammar import GrammarMatcher

    schema = {"oneOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "array", "items": {"type": "number"}}]}
    exact = GrammarCompiler(tokenizer, MODEL_VOCAB, config=GrammarSection().grammar_config())
    with pytest.raises(GrammarError) as refused:
        exact.compile(GrammarSpec.json_schema(schema))
    assert refused.value.feature == "oneOf" and GrammarSection().one_of == "exact"
    loose = GrammarCompiler(tokenizer, MODEL_VOCAB, config=GrammarSection(one_of="as_any_of").grammar_config())
    compiled = loose.compile(GrammarSpec.json_schema(schema))
    any_of = {"anyOf": schema["oneOf"]}
    for text, ok in (("[1, 2]", True), ("[1.5]", True), ("[]", True), ('["a"]', False), ("3", False)):
        m = GrammarMatcher(compiled)
        accepted = all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_completed()
        assert accepted == ok, text
        if accepted:
            jsonschema.validate(json.loads(text), any_of)
    exact.close()
    loose.close()
