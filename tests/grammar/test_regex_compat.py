"""regex_compat: after the rewrite, xgrammar accepts no string Python's `re` would reject."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import xgrammar as xgr

from moeserve.grammar import GrammarError, GrammarSpec
from moeserve.grammar.regex_compat import WS_ANY, WS_BOTH, xgrammar_regex

TRICKY = ["a", "b", "0", "1", "_", " ", "-", ".", ":", "é", "\u0663", "\n", "\t", "\x0b", "\x1c", "\x85", "\xa0", "\u2003", "\ufeff", '"', "\\"]
PATTERNS = [
    r".", r"\s", r"\S", r"[^\s]", r"[^:\s]+", r"\w", r"\W", r"\d", r"\D", r"[^\d]", r"[^\w-]", r"[\w.-]+", r"[\S]",
    r"a(b[01]+)?", r"(ab)?[01]{1,2}", r"[^a]", r"(a|b0+)?1", r"\d+(\.\d+)?",
    "(.|[\r\n])+", "[^\t\n]",  # raw control characters in a class (SchemaStore's github-actions has the first)
]


def _class_chars(spec: str) -> set[str]:
    out = set()
    for m in re.finditer(r"(.)-(.)|(.)", spec, re.S):
        lo, hi, one = m.groups()
        out |= {one} if one else {chr(c) for c in range(ord(lo), ord(hi) + 1)}
    return out


def test_whitespace_sets_are_the_intersection_and_union():
    python_ws = {chr(c) for c in range(0x10000) if re.fullmatch(r"\s", chr(c))}
    ecma_ws = {"\t", "\n", "\x0b", "\x0c", "\r", " ", "\xa0", "\u1680", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\ufeff"} | {
        chr(c) for c in range(0x2000, 0x200B)
    }
    assert _class_chars(WS_BOTH) == python_ws & ecma_ws
    assert _class_chars(WS_ANY) == python_ws | ecma_ws


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_kind_accepts_only_what_python_accepts(compiler, pattern):
    compiled = compiler.compile(GrammarSpec.regex(pattern))
    for n in (1, 2, 3):
        for chars in itertools.product(TRICKY[:12] if n == 3 else TRICKY, repeat=n):
            text = "".join(chars)
            m = xgr.GrammarMatcher(compiled.grammar)
            if m.accept_string(text) and m.is_completed():
                assert re.fullmatch(pattern, text), (pattern, text, compiled.source)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_schema_pattern_accepts_only_what_python_accepts(compiler, pattern):
    compiled = compiler.compile(GrammarSpec.json_schema({"type": "string", "pattern": f"^{pattern}$"}))
    for n in (1, 2):
        for chars in itertools.product(TRICKY, repeat=n):
            text = "".join(chars)
            m = xgr.GrammarMatcher(compiled.grammar)
            if m.accept_string(json.dumps(text, ensure_ascii=False)) and m.is_completed():
                assert re.search(f"^{pattern}$", text), (pattern, text, compiled.source)


def test_rewrites():
    assert xgrammar_regex("a(b)?", dot_excludes_newline=False) == "a(b){0,1}"
    assert xgrammar_regex(r"a\)?[)?]", dot_excludes_newline=False) == r"a\)?[)?]"
    assert xgrammar_regex("a.b[.]", dot_excludes_newline=True) == r"a[^\n]b[.]"
    assert xgrammar_regex(r"\S", dot_excludes_newline=False).startswith(r"[^ \u0009\u000a")
    assert xgrammar_regex(r"[^\d]", dot_excludes_newline=False).startswith("[ !")  # printable ASCII non-digits


def test_invalid_regex_is_a_grammar_error(compiler):
    with pytest.raises(GrammarError, match="invalid regex") as info:
        compiler.compile(GrammarSpec.regex("a(b"))
    assert info.value.feature == "invalid-regex"


# -- full_matches_never_search: checked against every short string over a small alphabet -------

SHAPE_PATTERNS = [
    r"^a$", r"^ab*$", r"^b+$", r"a", r"^\w$", r"_b", r"^(a|b)c$", r"^[ .-]+$", r"^[^ .-].*$", r"^u?int[0-9]*$",
    r"^uint[0-9]*$", r"^x(\[[0-9]*\])*$", r"^[a-c]{2,3}$", r"^.{1,2}$", r"c$", r"^\s*a", r"^(?:ab|ba)", r"^$",
    r"^[^.a]*$", r"\.\.", r"^[a-c]*$", r"[.x]", r"u(n|i)*", r"^(b|c[^a])+$",
]
SHAPE_ALPHABET = ["a", "b", "c", "_", " ", ".", "u", "i", "n", "t", "1", "x", "[", "]", "\n"]


def _strings(max_len: int):
    for n in range(max_len + 1):
        yield from ("".join(t) for t in itertools.product(SHAPE_ALPHABET, repeat=n))


@pytest.fixture(scope="module")
def short_strings() -> list[str]:
    return list(_strings(4))


def test_full_matches_never_search_is_never_wrong(short_strings):
    from moeserve.grammar.regex_facts import full_matches_never_search

    proved = 0
    for full, search in itertools.product(SHAPE_PATTERNS, repeat=2):
        if not full_matches_never_search(full, search):
            continue
        proved += 1
        witness = next((s for s in short_strings if re.fullmatch(full, s) and re.search(search, s)), None)
        assert witness is None, f"{full!r} / {search!r}: {witness!r} matches both"
    assert proved >= 40  # the proof is not vacuous: it decides many of these pairs


@pytest.mark.parametrize("chars", [{"a"}, {"."}, {" ", "b"}, {"]", "1"}])
def test_pattern_without_only_narrows_and_leaves_the_characters_out(short_strings, chars):
    from moeserve.grammar.regex_rewrite import pattern_without

    narrowed = 0
    for pattern in SHAPE_PATTERNS + [r"^[^]a]+$", r"^x[]a]*$", r"^[^.]+\.[^.]+$"]:
        new = pattern_without(pattern, chars)
        if new is None:
            continue
        narrowed += 1
        for s in short_strings:
            if re.fullmatch(new, s):
                assert re.fullmatch(pattern, s) and not set(s) & chars, f"{pattern!r} -> {new!r} matches {s!r}"
        kept = [s for s in short_strings if re.fullmatch(pattern, s) and not set(s) & chars]
        assert all(re.fullmatch(new, s) for s in kept), f"{pattern!r} -> {new!r} lost more than {chars}"
    assert narrowed >= 8


def test_full_matches_never_search_examples():
    from moeserve.grammar.regex_facts import full_matches_never_search

    assert full_matches_never_search(r"^u?int(8|16)?$", r"^address$")  # first characters differ
    assert full_matches_never_search(r"^\w$", r"_meta")  # one character never holds five
    assert full_matches_never_search(r"_meta", r"^\w$")
    assert not full_matches_never_search(r"^tuple\[\]$", r"tuple")  # unanchored: may match anywhere
    assert not full_matches_never_search(r"^(?i)a$", r"^A")  # case-insensitive: not decided


def test_finite_language_is_every_full_match(short_strings):
    from moeserve.grammar.regex_facts import finite_language

    decided = 0
    for pattern in SHAPE_PATTERNS + [r"^[a-c]$", r"^(1|3|4)$", r"^ab?c{1,2}$", r"^x(y|z)?$"]:
        language = finite_language(pattern)
        if language is None:
            continue
        decided += 1
        short = {s for s in short_strings if re.fullmatch(pattern, s)}
        assert short <= set(language), f"{pattern!r}: {sorted(short - set(language))} missing"
        assert all(re.fullmatch(pattern, s) for s in language)
    assert decided >= 6
    assert finite_language(r"^\w$") is None and finite_language(r"^a+$") is None  # too many / unbounded


def test_pattern_intersection_is_never_wrong(short_strings):
    from moeserve.grammar.schema_merge import _pattern_intersection

    decided = 0
    for p, q in itertools.product(SHAPE_PATTERNS + [r"^(ab|cd)$", r"^(a|b|ab)$"], repeat=2):
        both = _pattern_intersection(p, q)
        if both is None:
            continue
        decided += 1
        assert all(re.search(p, s) and re.search(q, s) for s in both), (p, q, both)
        if not both:
            witness = next((s for s in short_strings if re.search(p, s) and re.search(q, s)), None)
            assert witness is None, f"{p!r} & {q!r}: {witness!r} matches both"
    assert decided >= 20


LOOKAHEAD_PATTERNS = [r"^(?!ab)[a-c]+$", r"^(?!a.)(?!b1)[a-c1.]{1,3}$", r"^(?!.*\.\.)[a-c.]*$", r"^x(?!1)[0-9a]*$",
                      r"^(?!ca)[a-c]+(?:x|1)?$"]


@pytest.mark.parametrize("pattern", LOOKAHEAD_PATTERNS)
def test_negative_lookaheads_hold_by_construction(short_strings, pattern):
    """Dropping `(?!P)` and leaving out a character P needs only narrows, and keeps some matches."""
    from moeserve.grammar.regex_rewrite import lookarounds, without_negative_lookaheads

    new = without_negative_lookaheads(pattern)
    assert new is not None and not lookarounds(new)
    kept = [s for s in short_strings if re.fullmatch(new, s)]
    assert kept and all(re.fullmatch(pattern, s) for s in kept), (pattern, new)


@pytest.mark.parametrize("pattern", [r"^(?!\s*$).+$", r"^[a-z]+(?<!\.)$", r"^(?=a)\w+$", r"^(?!a)a$", r"^(?<=x)a$"])
def test_lookarounds_that_cannot_hold_by_construction_are_refused(pattern):
    """xgrammar ignores lookarounds (it would match more than the pattern): a pattern keeping one is refused."""
    with pytest.raises(GrammarError) as e:
        xgrammar_regex(pattern, dot_excludes_newline=False)
    assert e.value.feature == "lookaround"


def test_a_lookahead_is_not_read_inside_a_class_or_an_escape():
    from moeserve.grammar.regex_rewrite import lookarounds

    assert lookarounds(r"^[(?!]\(?!x$") == []
    assert [kind for *_, kind in lookarounds(r"^(?!a(b))(?<=c)(?=[)])x$")] == ["!", "<=", "="]


@pytest.mark.parametrize("pattern", [r"^(?=.{2,3}$)a.*", r"(?=^.{1,2}$)[a-c]+$", r"^(?=^[a-c1]+$).{2,4}$",
                                     r"^(?=[\s\S]{1,3}$)(?!.*\.\.)[a-c.]*$", r"^(?=.{0,2}$)x?[ab\n]*$"])
def test_a_leading_length_lookahead_becomes_length_bounds(short_strings, pattern):
    """Full matches of the pattern left, within the bounds, are strings the original (a search) accepts."""
    from moeserve.grammar.regex_rewrite import lengths_from_lookahead, lookarounds

    new, low, high = lengths_from_lookahead(pattern)
    assert not lookarounds(new)
    kept = [s for s in short_strings if low <= len(s) <= high and re.fullmatch(new, s)]
    assert kept and all(re.search(pattern, s) for s in kept), (pattern, new, low, high)


def test_other_leading_lookaheads_are_not_read_as_lengths():
    from moeserve.grammar.regex_rewrite import lengths_from_lookahead

    for pattern in (r"(?=.{1,3}$)a", r"^(?=.*\d)[a-z0-9]+$", r"^a(?=.{1,3}$).*", r"^(?=.{1,3})a.*"):
        assert lengths_from_lookahead(pattern) is None, pattern


def test_eight_digit_escapes_are_read_as_one_character():
    """`\\U0000XXXX` is one character to Python's re; xgrammar would read a "U" and eight digits."""
    assert xgrammar_regex(r"^a\U000000e9$", dot_excludes_newline=False) == r"^a\u00e9$"
    with pytest.raises(GrammarError) as e:
        xgrammar_regex(r"^\U0001F600$", dot_excludes_newline=False)
    assert e.value.feature == "pattern"
