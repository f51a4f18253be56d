"""Property 3 (DESIGN.md): every completion under a grammar is accepted by that grammar.

A random "model" (seeded random logits) decodes under the mask, with jump-forward and the
closing bias, and an independent oracle judges the text the client would receive: `json` +
`jsonschema` (formats asserted), `re.fullmatch`, choice membership, and for EBNF a hand-written
recursive-descent checker of the grammar's language.
"""

from __future__ import annotations

import re

import pytest

from bench.grammar_decoding import random_decode
from bench.oracle import check_output
from moeserve.grammar import GrammarSpec
from moeserve.grammar.formats import FORMAT_PATTERNS, SUPPORTED_FORMATS

SEEDS = range(30)

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "customer": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "pickup": {"type": "string", "format": "date-time"},
        "status": {"enum": ["pending", "baked", "collected"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z]+( [a-z]+)?$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 12},
                    "price": {"type": "number", "exclusiveMinimum": 0},
                },
                "required": ["name", "quantity"],
                "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"]},
        "paid": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "status"],
}

SCHEMAS = {
    "order": ORDER,
    "anyOf+ref": {
        "$defs": {"money": {"type": "object", "properties": {"amount": {"type": "number"}, "currency": {"const": "EUR"}}, "required": ["amount", "currency"]}},
        "type": "object",
        "properties": {"total": {"anyOf": [{"$ref": "#/$defs/money"}, {"type": "null"}]}, "ids": {"type": "array", "items": {"type": "integer", "multipleOf": 7}}},
        "required": ["total"],
    },
    "recursive tree": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 3}}, "required": ["v"]},
    "allOf + oneOf": {
        "allOf": [{"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]}],
        "oneOf": [
            {"properties": {"kind": {"const": "a"}, "x": {"type": "string", "format": "uuid"}}, "required": ["x"]},
            {"properties": {"kind": {"const": "b"}, "y": {"type": "string", "format": "date"}}, "required": ["y"]},
        ],
    },
    "tuple (draft-07)": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "string", "format": "ipv4"}, {"type": "integer"}], "additionalItems": {"type": "boolean"}},
    "free-form": {"type": "object", "additionalProperties": {"type": ["string", "number", "array"]}, "maxProperties": 3},
    # narrowed, not refused: uniqueItems (at most one item), not {type} (the other types), not both of two properties
    "narrowed not / uniqueItems": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True},
                       "any": {"not": {"type": ["array", "object", "string"]}}, "site": {"type": "string"},
                       "app": {"type": "string"}},
        "not": {"allOf": [{"required": ["site"]}, {"required": ["app"]}]},
        "required": ["tags", "any"],
    },
    # narrowed: contains by the first items (2020-12: minContains), a regex as literal text, minProperties
    # beside propertyNames by fresh declared names
    "contains / format regex": {
        "type": "object",
        "properties": {"steps": {"type": "array", "items": {"type": "integer", "maximum": 9},
                                 "contains": {"minimum": 5}, "minContains": 2},
                       "tags": {"type": "array", "contains": {"const": "x"}},
                       "match": {"type": "string", "format": "regex"},
                       "layout": {"type": "object", "propertyNames": {"enum": ["symlink", "bind"]},
                                  "additionalProperties": {"type": "string"}, "minProperties": 1}},
        "required": ["steps", "tags", "match", "layout"],
    },
}

REGEXES = [
    r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]+( [A-Z][a-z]+)*",
    r"(0|[1-9][0-9]*)(\.[0-9]+)?",
    r"[^\n]{1,20}\n[^\n]{1,20}",
    r"(é|ü|日本)+",
]

CHOICES = [["sourdough", "rye", "spelt"], ["yes", "no"], ['say "hi"', "back\\slash", "two\nlines", "emoji 😀", "sourdough bread", "sourdough"]]

# root ::= "[" item ("," item)* "]" with nested lists or numbers: our oracle is recursive descent
EBNF = 'root ::= list\nlist ::= "[" item ("," item)* "]"\nitem ::= [0-9]+ | list | "x"'


def ebnf_language(text: str) -> bool:
    pos = 0

    def item() -> bool:
        nonlocal pos
        if text.startswith("[", pos):
            return lst()
        m = re.compile(r"[0-9]+|x").match(text, pos)
        if m:
            pos = m.end()
        return bool(m)

    def lst() -> bool:
        nonlocal pos
        if not text.startswith("[", pos):
            return False
        pos += 1
        if not item():
            return False
        while text.startswith(",", pos):
            pos += 1
            if not item():
                return False
        if not text.startswith("]", pos):
            return False
        pos += 1
        return True

    return lst() and pos == len(text)


def assert_all_valid(compiler, tokenizer, spec: GrammarSpec, check=None, *, jump_forward: bool = True) -> None:
    compiled = compiler.compile(spec)
    for seed in SEEDS:
        out = random_decode(compiler, compiled, tokenizer, seed=seed, jump_forward=jump_forward)
        assert out.terminated, f"seed {seed}: no end within the budget: {out.text[:200]!r}"
        assert out.utf8_ok and out.text == out.grammar_text, f"seed {seed}: client text differs from checked bytes"
        reason = check_output(spec, out.text) if check is None else (None if check(out.text) else "not in the language")
        assert reason is None, f"seed {seed}: {reason}: {out.text!r}"


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(compiler, tokenizer, name):
    assert_all_valid(compiler, tokenizer, GrammarSpec.json_schema(SCHEMAS[name]))


def test_json_schema_without_jump_forward(compiler, tokenizer):
    assert_all_valid(compiler, tokenizer, GrammarSpec.json_schema(ORDER), jump_forward=False)


def test_json_object_outputs_are_objects(compiler, tokenizer):
    assert_all_valid(compiler, tokenizer, GrammarSpec.json_object())


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(compiler, tokenizer, pattern):
    assert_all_valid(compiler, tokenizer, GrammarSpec.regex(pattern))


@pytest.mark.parametrize("choices", CHOICES, ids=lambda c: c[0])
def test_choice_outputs_are_choices(compiler, tokenizer, choices):
    assert_all_valid(compiler, tokenizer, GrammarSpec.choice(choices))


def test_ebnf_outputs_are_in_the_language(compiler, tokenizer):
    assert ebnf_language("[1,[x,22],[[3]]]") and not ebnf_language("[1,]") and not ebnf_language("[1]]")
    assert_all_valid(compiler, tokenizer, GrammarSpec.ebnf(EBNF), check=ebnf_language)


def test_the_oracle_rejects(compiler):
    spec = GrammarSpec.json_schema(ORDER)
    assert "not JSON" in check_output(spec, '{"order_id": 1')
    assert "schema violation" in check_output(spec, '{"order_id": 0, "customer": "a", "items": [], "status": "x"}')
    assert "is not a 'date-time'" in check_output(GrammarSpec.json_schema({"format": "date-time"}), '"2023-02-30T00:00:00Z"')
    assert check_output(GrammarSpec.json_object(), "NaN") is not None
    assert check_output(GrammarSpec.regex("a+"), "aab") is not None
    assert check_output(GrammarSpec.choice(["a"]), "b") is not None


@pytest.mark.parametrize("fmt", sorted(SUPPORTED_FORMATS | FORMAT_PATTERNS.keys()))
def test_every_accepted_format_produces_valid_strings(compiler, tokenizer, fmt):
    # Early, middle and late closing: random strings of every length the format allows.
    spec = GrammarSpec.json_schema({"type": "string", "format": fmt})
    compiled = compiler.compile(spec)
    for seed in range(15):
        for budget in (4, 48, 160):
            out = random_decode(compiler, compiled, tokenizer, seed=seed, budget=budget)
            assert out.terminated and check_output(spec, out.text) is None, (fmt, out.text)


def test_oracle_multiple_of_beyond_float_range():
    """jsonschema divides as floats, which overflows past 1e308; the oracle still decides."""
    from moeserve.grammar import GrammarSpec

    big = "1" + "0" * 400
    assert check_output(GrammarSpec.json_schema({"type": "number", "multipleOf": 0.5}), big) is None
    assert "not a multiple" in check_output(GrammarSpec.json_schema({"type": "number", "multipleOf": 0.3}), big + "1")
