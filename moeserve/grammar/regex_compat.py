"""Regexes as validators read them, rewritten so xgrammar 0.2.9 matches no more than that.

The client's regex (a JSON-Schema `pattern`, or `guided_regex`) is judged by Python's `re`
(jsonschema's `pattern`, our oracle's `re.fullmatch`). Measured against it, xgrammar's regex
engines are mostly narrower (their `\\d`, `\\w` are ASCII), which is safe, but in places wider:

- `.` matches a newline in `guided_regex` (Python's does not);
- `\\s` matches U+FEFF; `\\S` and `[^\\s]` match U+0085 and U+001C-U+001F (whitespace to Python);
- `\\D`, `\\W`, `[^\\d]`, `[^\\w]` match non-ASCII digits and letters (not \\D / \\W to Python);
- in a JSON-Schema pattern, an optional group starting with a literal and going on with a
  variable repetition loses the literal: `^a(b[01]+)?$` accepts "a0".

`xgrammar_regex` rewrites each into an equal or narrower form xgrammar gets right: whitespace
classes spelled out (the intersection of Python's and ECMA-262's whitespace where a match is
wanted, their union where it is excluded), classes with other shorthands reduced to the
printable ASCII characters Python says they match, `.` to `[^\\n]`, and `)?` to `){0,1}`.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from moeserve.grammar.errors import GrammarError

# Whitespace to both Python's re and ECMA-262 (what `\s` may match) / to either (what `\S` must not).
WS_BOTH = " \t\n\r\x0b\x0c\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
WS_ANY = WS_BOTH + "\x1c-\x1f\x85\ufeff"
_NARROWED = {"D": "\x00-/:-\x7f", "W": "\x00-/:-@[-^`{-\x7f"}  # ASCII non-digits / non-word characters
_PRINTABLE = [chr(c) for c in range(0x20, 0x7F)]


def _spelled(chars: str) -> str:
    """Class text with every character outside printable ASCII as \\uXXXX (xgrammar refuses raw
    control characters in a class and reads \\xHH greedily)."""
    return "".join(c if 0x20 <= ord(c) < 0x7F else f"\\u{ord(c):04x}" for c in chars)


def xgrammar_regex(pattern: str, *, dot_excludes_newline: bool) -> str:
    """`pattern` rewritten as in the module docstring; raises GrammarError if it does not parse."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise GrammarError(f"invalid regular expression {pattern!r}: {e}", feature="pattern") from None
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            esc = pattern[i : i + 2]
            if esc == "\\s":
                out.append(f"[{_spelled(WS_BOTH)}]")
            elif esc == "\\S":
                out.append(f"[^{_spelled(WS_ANY)}]")
            elif esc[1:] in _NARROWED:
                out.append(f"[{_spelled(_NARROWED[esc[1:]])}]")
            else:
                out.append(esc)
            i += 2
        elif ch == "[":
            end = _class_end(pattern, i)
            out.append(_rewrite_class(pattern[i : end + 1]))
            i = end + 1
        elif ch == ")" and pattern[i + 1 : i + 2] == "?":
            out.append("){0,1}")
            i += 2
        elif ch == "." and dot_excludes_newline:
            out.append("[^\\n]")
            i += 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _class_end(pattern: str, start: int) -> int:
    """Index of the `]` closing the class opened at `start` (a leading `]` or `^]` is literal)."""
    i = start + 1
    if pattern[i : i + 1] == "^":
        i += 1
    if pattern[i : i + 1] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i


def _rewrite_class(text: str) -> str:
    negated = text.startswith("[^")
    body = text[2:-1] if negated else text[1:-1]
    shorthands = set(re.findall(r"\\([sSdDwW])", body))
    if not shorthands:
        return text
    if shorthands <= {"s"} or (shorthands <= {"s", "d", "w"} and not negated):
        return "[" + ("^" if negated else "") + body.replace("\\s", _spelled(WS_ANY if negated else WS_BOTH)) + "]"
    # Anything else: the printable ASCII characters Python says the class matches (narrower, exact there).
    members = [c for c in _PRINTABLE if re.fullmatch(text, c)]
    if not members:
        raise GrammarError(f"character class {text!r} matches no printable ASCII character", feature="pattern")
    return "[" + "".join("\\" + c if c in "\\]^-[" else c for c in members) + "]"


# -- what a regex's matches look like: for proving two patterns never match the same string ----

try:  # the regex parser behind `re`
    from re import _constants as sre_c
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

_MAX_CLASS_SPAN = 4096  # a wider range makes a first-character set "unknown"


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


@functools.lru_cache(maxsize=1024)
def regex_shape(pattern: str) -> RegexShape | None:
    try:
        parsed = sre_parse.parse(pattern)
        low, high = parsed.getwidth()
    except (re.error, OverflowError, RecursionError):
        return None
    items = list(parsed)
    begin = (sre_c.AT, sre_c.AT_BEGINNING)
    end = (sre_c.AT, sre_c.AT_END)
    anchored = bool(items) and tuple(items[0]) == begin
    return RegexShape(
        first=None if parsed.state.flags & re.IGNORECASE else _first(items),
        min_len=low,
        max_len=math.inf if high >= sre_c.MAXREPEAT else high,
        anchored=anchored,
        anchored_end=anchored and tuple(items[-1]) == end,
    )


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
    return s.anchored and s.min_len > 0 and f.first is not None and s.first is not None and f.first.disjoint(s.first)


def _first(items: list) -> CharSet | None:
    """Characters a non-empty match of the sequence can start with (zero-width items skipped)."""
    out = CharSet(frozenset())
    for op, av in items:
        if op is sre_c.AT:
            continue
        got = _first_of(op, av)
        if got is None:
            return None
        first, may_be_empty = got
        out = out | first
        if not may_be_empty:
            return out
    return out


def _first_of(op, av) -> tuple[CharSet, bool] | None:
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
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", sre_c.MAX_REPEAT)):
        low, _high, sub = av
        first = _first(list(sub))
        return None if first is None else (first, low == 0 or sub.getwidth()[0] == 0)
    return None


@functools.cache
def _unicode_spaces() -> frozenset[str]:
    return frozenset(chr(c) for c in range(0x110000) if chr(c).isspace())


def class_outside(chars: CharSet) -> str | None:
    """A regex character class matching what `chars` does not (None when not expressible)."""
    if chars.negated or any(ord(c) > 0xFFFF for c in chars.chars):
        return None
    return "[^" + "".join(f"\\u{ord(c):04x}" for c in sorted(chars.chars)) + "]"


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
    if items and tuple(items[0]) == (sre_c.AT, sre_c.AT_BEGINNING):
        items = items[1:]
    if items and tuple(items[-1]) == (sre_c.AT, sre_c.AT_END):
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
