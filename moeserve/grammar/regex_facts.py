"""What a regex's matches look like as Python's `re` reads it: first characters, length bounds and
anchors (`regex_shape`), and every full match when there are few (`finite_language`). Used to prove
two patterns never match one string and to turn a pattern naming a few keys into those keys.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from moeserve.grammar.errors import GrammarError

try:  # the regex parser behind `re`
    from re import _constants as sre_c
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

_MAX_CLASS_SPAN = 4096  # a wider range makes a first-character set "unknown"
_BEGIN, _END = (sre_c.AT, sre_c.AT_BEGINNING), (sre_c.AT, sre_c.AT_END)
_REPEATS = (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", sre_c.MAX_REPEAT))


@dataclass(frozen=True)
class CharSet:
    """A set of characters: `chars`, or (negated) every character but `chars`."""

    chars: frozenset[str]
    negated: bool = False

    def __or__(self, other: CharSet) -> CharSet:
        if not self.negated and not other.negated:
            return CharSet(self.chars | other.chars)
        if self.negated and other.negated:
            return CharSet(self.chars & other.chars, True)
        inside, outside = (other, self) if self.negated else (self, other)
        return CharSet(outside.chars - inside.chars, True)

    def disjoint(self, other: CharSet) -> bool:
        if self.negated and other.negated:
            return False
        if not self.negated and not other.negated:
            return not self.chars & other.chars
        inside, outside = (other, self) if self.negated else (self, other)
        return inside.chars <= outside.chars


@dataclass(frozen=True)
class RegexShape:
    """Facts about the strings a pattern matches (as Python's `re` reads it)."""

    first: CharSet | None  # what a non-empty match starts with; None: not known
    min_len: int
    max_len: float
    anchored: bool  # a search can only match at the start (leading ^, no top-level |)
    anchored_end: bool  # ... and only up to the end (trailing $), give or take a final newline
    chars: CharSet | None  # every character a match may contain; None: not known
    required: frozenset[str]  # characters every match contains


@functools.lru_cache(maxsize=1024)
def regex_shape(pattern: str) -> RegexShape | None:
    try:
        parsed = sre_parse.parse(pattern)
        low, high = parsed.getwidth()
    except (re.error, OverflowError, RecursionError):
        return None
    items = list(parsed)
    anchored = bool(items) and tuple(items[0]) == _BEGIN
    return RegexShape(first=None if parsed.state.flags & re.IGNORECASE else _first(items), min_len=low,
                      max_len=math.inf if high >= sre_c.MAXREPEAT else high, anchored=anchored,
                      anchored_end=anchored and tuple(items[-1]) == _END,
                      chars=None if parsed.state.flags & re.IGNORECASE else _alphabet(items),
                      required=frozenset() if parsed.state.flags & re.IGNORECASE else _required(items))


def full_matches_never_search(full: str, search: str) -> bool:
    """Provably, no string that fully matches `full` contains a match of `search` (by length or
    by the first character of a match anchored at the start)."""
    f, s = regex_shape(full), regex_shape(search)
    if f is None or s is None:
        return False
    if f.max_len < s.min_len:
        return True
    if s.anchored_end and f.min_len > s.max_len + 1:  # `$` also matches before a final newline
        return True
    if f.chars is not None and any(f.chars.disjoint(CharSet(frozenset(c))) for c in s.required):
        return True  # a match needs a character the string never has
    if s.min_len == 0 or s.first is None:
        return False
    if f.chars is not None and f.chars.disjoint(s.first):  # no character of the string can start a match
        return True
    return s.anchored and f.first is not None and f.first.disjoint(s.first)


def _first(items: list) -> CharSet | None:
    """Characters a non-empty match of the sequence can start with (zero-width items skipped)."""
    out = CharSet(frozenset())
    for op, av in items:
        if op is sre_c.AT:
            continue
        got = first_of(op, av)
        if got is None:
            return None
        first, may_be_empty = got
        out = out | first
        if not may_be_empty:
            return out
    return out


def _alphabet(items: list) -> CharSet | None:
    """Every character a match of the sequence may contain (None: not known)."""
    out = CharSet(frozenset())
    for op, av in items:
        if op is sre_c.AT:
            continue
        if op is sre_c.ANY:
            got = CharSet(frozenset("\n"), True)
        elif op in (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.IN):
            got = (first_of(op, av) or (None,))[0]
        elif op is sre_c.SUBPATTERN:
            got = None if av[1] & re.IGNORECASE else _alphabet(list(av[3]))
        elif op is sre_c.BRANCH:
            alts = [_alphabet(list(alt)) for alt in av[1]]
            got = None if None in alts else functools.reduce(CharSet.__or__, alts, CharSet(frozenset()))
        elif op in _REPEATS:
            got = _alphabet(list(av[2]))
        else:
            return None
        if got is None:
            return None
        out = out | got
    return out


def _required(items: list) -> frozenset[str]:
    """Characters every match of the sequence contains (literals outside optional parts)."""
    out: set[str] = set()
    for op, av in items:
        if op is sre_c.LITERAL:
            out.add(chr(av))
        elif op is sre_c.SUBPATTERN and not av[1] & re.IGNORECASE:
            out |= _required(list(av[3]))
        elif op in _REPEATS and av[0] >= 1:
            out |= _required(list(av[2]))
        elif op is sre_c.BRANCH:
            out |= frozenset.intersection(*(_required(list(alt)) for alt in av[1]))
    return frozenset(out)


def first_of(op, av) -> tuple[CharSet, bool] | None:
    if op is sre_c.LITERAL:
        return CharSet(frozenset(chr(av))), False
    if op is sre_c.NOT_LITERAL:
        return CharSet(frozenset(chr(av)), True), False
    if op is sre_c.IN:
        chars, negated = set(), False
        for kind, value in av:
            if kind is sre_c.NEGATE:
                negated = True
            elif kind is sre_c.LITERAL:
                chars.add(chr(value))
            elif kind is sre_c.RANGE and value[1] - value[0] <= _MAX_CLASS_SPAN:
                chars.update(chr(c) for c in range(value[0], value[1] + 1))
            elif kind is sre_c.CATEGORY and value is sre_c.CATEGORY_SPACE:
                chars.update(_unicode_spaces())
            else:
                return None
        return CharSet(frozenset(chars), negated), False
    if op is sre_c.SUBPATTERN:
        _group, add_flags, _del_flags, sub = av
        first = None if add_flags & re.IGNORECASE else _first(list(sub))
        return None if first is None else (first, sub.getwidth()[0] == 0)
    if op is sre_c.BRANCH:
        out, empty = CharSet(frozenset()), False
        for alt in av[1]:
            first = _first(list(alt))
            if first is None:
                return None
            out, empty = out | first, empty or alt.getwidth()[0] == 0
        return out, empty
    if op in _REPEATS:
        low, _high, sub = av
        first = _first(list(sub))
        return None if first is None else (first, low == 0 or sub.getwidth()[0] == 0)
    return None


@functools.cache
def _unicode_spaces() -> frozenset[str]:
    return frozenset(chr(c) for c in range(0x110000) if chr(c).isspace())


@functools.lru_cache(maxsize=1024)
def finite_language(pattern: str, limit: int = 16) -> tuple[str, ...] | None:
    """Every string that fully matches `pattern`, when there are at most `limit` (else None)."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, OverflowError, RecursionError):
        return None
    if parsed.state.flags & re.IGNORECASE:
        return None
    items = list(parsed)
    if items and tuple(items[0]) == _BEGIN:
        items = items[1:]
    if items and tuple(items[-1]) == _END:
        items = items[:-1]
    strings = _language(items, limit)
    return None if strings is None else tuple(sorted(s for s in strings if re.fullmatch(pattern, s)))


def _language(items: list, limit: int) -> set[str] | None:
    out = {""}
    for op, av in items:
        part = _language_of(op, av, limit)
        if part is None:
            return None
        out = {a + b for a in out for b in part}
        if len(out) > limit:
            return None
    return out


def _language_of(op, av, limit: int) -> set[str] | None:
    if op is sre_c.LITERAL:
        return {chr(av)}
    if op is sre_c.IN:
        chars = set()
        for kind, value in av:
            if kind is sre_c.LITERAL:
                chars.add(chr(value))
            elif kind is sre_c.RANGE and value[1] - value[0] < limit:
                chars.update(chr(c) for c in range(value[0], value[1] + 1))
            else:
                return None
        return chars
    if op is sre_c.SUBPATTERN:
        return None if av[1] & re.IGNORECASE else _language(list(av[3]), limit)
    if op is sre_c.BRANCH:
        out: set[str] = set()
        for alt in av[1]:
            part = _language(list(alt), limit)
            if part is None:
                return None
            out |= part
        return out if len(out) <= limit else None
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT) and av[1] <= limit:
        low, high, sub = av
        base = _language(list(sub), limit)
        if base is None:
            return None
        out, layer = set(), {""}
        for count in range(high + 1):
            if count >= low:
                out |= layer
            if len(out) > limit:
                return None
            layer = {a + b for a in layer for b in base}
            if len(layer) > limit * max(1, len(base)):
                return None
        return out
    return None


def key_matches(pattern: str, name: str) -> bool:
    """Does property name `name` match the patternProperties `pattern` (search, as validators read it)?"""
    try:
        return re.search(pattern, name) is not None
    except re.error as e:
        raise GrammarError(f"invalid regular expression {pattern!r}: {e}", feature="patternProperties") from None
