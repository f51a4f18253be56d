"""ECMA-262 Unicode property classes in schema patterns: spelled out exactly (the `regex` package is the
oracle), enforced, and left alone where they are data."""

from __future__ import annotations

import json
import random
import re
import unicodedata

import pytest
import regex

from moeserve.grammar import GrammarMatcher, GrammarSpec
from moeserve.grammar.unicode_classes import python_pattern, with_python_patterns

PROPERTY_PATTERNS = [r"^\P{C}*$", r"^\p{ASCII}+$", r"^([\p{L}\p{Z}\p{N}_.:/=+\-@]*)$", r"^[^\p{Cc}]+$",
                     r"^\p{Letter}\p{gc=Nd}?$", r"^\P{Lu}$", r"^[\P{L}x]$", r"^\p{General_Category=Sc}$", r"^\p{LC}$"]


def _assigned_sample() -> list[str]:
    """Every Latin-1 character and 20,000 random code points, less those this Python's Unicode tables leave
    unassigned (the `regex` package may know a newer Unicode, where they have a category)."""
    rng = random.Random(0)
    points = list(range(0x100)) + [rng.randrange(0x110000) for _ in range(20_000)]
    return [chr(c) for c in points if unicodedata.category(chr(c)) != "Cn"]


@pytest.mark.parametrize("pattern", PROPERTY_PATTERNS)
def test_property_classes_are_spelled_out_exactly(pattern):
    spelled = re.compile(python_pattern(pattern))
    oracle = regex.compile(pattern)
    wrong = [hex(ord(c)) for c in _assigned_sample() if bool(spelled.fullmatch(c)) != bool(oracle.fullmatch(c))]
    assert not wrong, wrong[:10]


def test_unknown_properties_and_escaped_backslashes_are_left_as_written():
    assert python_pattern(r"^[\p{Graph}\x20]*$") == r"^[\p{Graph}\x20]*$"  # Java's, not ECMA-262's: re refuses it
    assert python_pattern(r"^a\\p{L}$") == r"^a\\p{L}$"  # a backslash, then "p{L}"
    assert python_pattern(r"^\p{Greek}$") == r"^\p{Greek}$"


def test_only_schema_patterns_are_rewritten():
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": r"^\p{Lu}$"}},
              "patternProperties": {r"^\p{Ll}+$": {"pattern": r"\p{N}"}},
              "enum": [{"pattern": r"\p{L}"}], "default": {"pattern": r"\p{L}"}}
    out = with_python_patterns(schema)
    assert out["enum"] == schema["enum"] and out["default"] == schema["default"]
    assert out["properties"]["pattern"]["pattern"] == python_pattern(r"^\p{Lu}$") != r"^\p{Lu}$"
    [(key, sub)] = out["patternProperties"].items()
    assert key == python_pattern(r"^\p{Ll}+$") and sub["pattern"] == python_pattern(r"\p{N}")


def test_a_schema_with_property_classes_compiles_and_is_enforced(compiler):
    def accepts(compiled, instance, tokenizer) -> bool:
        ids = tokenizer.encode(json.dumps(instance, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False)
        matcher = GrammarMatcher(compiled)
        return matcher.accept_tokens(ids) == len(ids) and matcher.is_completed()

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "pattern": r"^[\p{L}\p{Zs}]{1,8}$"},
        "note": {"type": "string", "pattern": r"^[^\p{Cc}]*$"}}, "required": ["name", "note"],
        "additionalProperties": False}
    compiled = compiler.compile(GrammarSpec.json_schema(schema))
    assert accepts(compiled, {"name": "Ana Été", "note": "ok"}, compiler.tokenizer)
    for bad in ({"name": "a1", "note": ""}, {"name": "", "note": ""}, {"name": "a", "note": "\u0007"}):
        assert not accepts(compiled, bad, compiler.tokenizer), bad
