"""Raw xgrammar 0.2.9 behaviour that the grammar layer works around, measured.

Each test asserts the quirk is still there. If one fails after an xgrammar upgrade, the quirk
is fixed upstream: delete the named workaround (and this test) rather than keep both.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

ASCII = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])


@pytest.fixture(scope="module")
def raw():
    return xgr.GrammarCompiler(ASCII, max_threads=1, cache_enabled=False)


def raw_accepts(compiled: xgr.CompiledGrammar, text: str | bytes) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


def schema(raw, s: dict) -> xgr.CompiledGrammar:
    return raw.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(",", ":"))


def test_optional_group_in_pattern_loses_its_literal(raw):
    # workaround: regex_compat.xgrammar_regex rewrites ")?" to "){0,1}"
    assert raw_accepts(schema(raw, {"type": "string", "pattern": "^a(b[01]+)?$"}), '"a0"')
    assert not raw_accepts(schema(raw, {"type": "string", "pattern": "^a(b[01]+){0,1}$"}), '"a0"')


def test_surrogates_and_overlong_utf8_accepted(raw):
    # workaround: utf8.py (blank invalid tokens, range-check the byte after E0/ED/F0/F4)
    assert raw_accepts(schema(raw, {"type": "string"}), b'"\xed\xa0\x80"')
    assert raw_accepts(schema(raw, {"type": "string", "pattern": "^[^:]+$"}), b'"\xf0\x8d\x8c\x97"')


def test_raw_control_characters_in_length_bounded_strings(raw):
    # workaround: tokenizer_info.py blanks control-byte tokens for JSON grammars
    assert raw_accepts(schema(raw, {"type": "string", "minLength": 1}), '"a\x01"')


def test_ignored_keywords(raw):
    # workaround: schema_node.py refuses or rewrites each of these
    assert raw_accepts(schema(raw, {"type": "number", "multipleOf": 0.5}), "1.3")
    assert raw_accepts(schema(raw, {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "[1,1]")
    assert raw_accepts(schema(raw, {"not": {"type": "integer"}}), "1")
    assert raw_accepts(schema(raw, {"minimum": 3}), "2")  # no type: keyword ignored
    assert raw_accepts(schema(raw, {"type": "string", "pattern": "^a", "minLength": 3}), '"a"')
    assert raw_accepts(schema(raw, {"type": "string", "format": "email", "maxLength": 3}), '"aaaa@b.co"')
    assert raw_accepts(schema(raw, {"type": "string", "enum": ["a", 1]}), "1")  # type beside enum


def test_combinators_not_enforced(raw):
    # workaround: schema_merge.py (allOf, siblings), SchemaNormalizer.exclusive (oneOf)
    both = {"allOf": [{"type": "integer"}, {"minimum": 3}]}
    assert raw_accepts(schema(raw, both), "2")
    siblings = {"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}
    assert raw_accepts(schema(raw, siblings), "[]")
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    assert raw_accepts(schema(raw, overlapping), "1")
    required_undeclared = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}
    assert raw_accepts(schema(raw, required_undeclared), '{"a":1}')


def test_date_format_ignores_month_lengths(raw):
    # workaround: schema_node.FORMAT_PATTERNS
    assert raw_accepts(schema(raw, {"type": "string", "format": "date"}), '"2023-11-31"')


def test_ebnf_hex_escape_reads_past_two_digits(raw):
    # workaround: compiler.ebnf_literal writes \\u00HH
    assert not raw_accepts(raw.compile_grammar(r'root ::= "a\x0ab"'), "a\nb")


def test_regex_classes_wider_than_pythons(raw):
    # workaround: regex_compat.xgrammar_regex
    assert raw_accepts(raw.compile_regex("a.b"), "a\nb")  # Python's "." excludes "\n"
    assert raw_accepts(raw.compile_regex(r"\s"), "\ufeff")  # not whitespace to Python
    assert raw_accepts(raw.compile_regex(r"[^\s]"), "\x85")  # whitespace to Python
    assert raw_accepts(raw.compile_regex(r"\D"), "\u0663")  # ARABIC-INDIC DIGIT THREE is a digit to Python
    assert raw_accepts(schema(raw, {"type": "string", "pattern": r"^\W$"}), '"\u00e9"')  # é is a word character
