"""Regexes rewritten narrower: a pattern whose full matches leave some characters out (`pattern_without`),
a class of what a set does not match (`class_outside`), length bounds folded into a pattern
(`fold_lengths_into_pattern`), negative lookaheads made to hold everywhere (`without_negative_lookaheads`), a
leading lookahead that bounds the length read as length bounds (`lengths_from_lookahead`).
Each result fully matches only strings the original fully matches.
"""

from __future__ import annotations

import re

from moeserve.grammar.regex_facts import CharSet, first_of, regex_shape, sre_parse

MAX_FOLDED_REPEAT = 1024
MAX_FOLDED_CLASS = 256  # characters of class text; a wider class keeps its bounds (llguidance then)
# A prefix, then one character class or escaped/plain character, repeated: ^ab[a-z0-9-]*$, ^\d+$
_TAIL_STAR_PATTERN = re.compile(r"\^(.*?)(\[(?:\\.|[^\]\\])+\]|\\[dDwWsS]|\.|[A-Za-z0-9 _-])([*+])\$")


def pattern_without(pattern: str, chars: set[str]) -> str | None:
    """`pattern` narrowed so its full matches never contain `chars`: its classes and `.` leave them out.
    None when that is not shown (a literal or an escape may still produce one, or a class cannot be read)."""
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "[":
            j = class_end(pattern, i)
            try:
                (op, av), = sre_parse.parse(pattern[i:j + 1])
            except (re.error, ValueError):
                return None
            got = first_of(op, av)
            if got is None:
                return None
            kept = CharSet(got[0].chars | chars, True) if got[0].negated else CharSet(got[0].chars - chars)
            ch, i = class_text(kept), j
        elif ch == ".":
            ch = class_text(CharSet(frozenset("\n") | chars, True))
        if ch is None:
            return None
        out.append(ch)
        i += 1
    narrowed = "".join(out)
    shape = regex_shape(narrowed)
    if shape is None or shape.chars is None or not shape.chars.disjoint(CharSet(frozenset(chars))):
        return None
    return narrowed


def class_end(pattern: str, start: int) -> int:
    """Index of the `]` closing the class opened at `start` (a leading `]` or `^]` is literal)."""
    i = start + 1 + pattern.startswith("^", start + 1)
    i += pattern.startswith("]", i)
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i


def lookarounds(pattern: str) -> list[tuple[int, int, str]]:
    """The outermost lookaround groups of `pattern`: (start, end past the `)`, kind: "!", "=", "<!" or "<=")."""
    found, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
        elif pattern[i] == "[":
            i = class_end(pattern, i) + 1
        elif (m := re.match(r"\(\?(<?[!=])", pattern[i:])):
            end = _group_end(pattern, i)
            found.append((i, end, m.group(1)))
            i = end
        else:
            i += 1
    return found


def _group_end(pattern: str, start: int) -> int:
    """Index past the `)` closing the group opened at `start`."""
    depth, i = 0, start
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 1
        elif pattern[i] == "[":
            i = class_end(pattern, i)
        elif pattern[i] == "(":
            depth += 1
        elif pattern[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(pattern)


def without_negative_lookaheads(pattern: str) -> str | None:
    """`pattern` with its `(?!P)` groups dropped and, for each P, a character every match of P needs left out
    of the rest (`pattern_without`): a string without that character holds no match of P anywhere, so
    every one of those assertions holds. Punctuation is left out before letters and digits, one character
    serving several P where it can. None when some P needs no character, or another lookaround is there."""
    groups = lookarounds(pattern)
    if any(kind != "!" for _, _, kind in groups):
        return None
    needs = []
    for start, end, _ in groups:
        inner = pattern[start + 3:end - 1]
        shape = regex_shape(inner)
        if shape is None or not shape.required or lookarounds(inner):
            return None
        needs.append(shape.required)
    rest = "".join(pattern[a:b] for a, b in zip([0] + [e for _, e, _ in groups], [s for s, _, _ in groups] + [len(pattern)]))
    left_out: set[str] = set()
    for need in needs:
        if not need & left_out:
            left_out.add(min(need, key=lambda c: (-sum(c in n for n in needs), c.isalnum(), c)))
    return pattern_without(rest, left_out) if left_out else rest


_LENGTH = r"(\.|\[\\s\\S\]|\[\\S\\s\])\{(\d+),(\d+)\}"
# ^(?=.{m,n}$)R and (?=^.{m,n}$)R; ^(?=^P$).{m,n}$
_LENGTH_FIRST = re.compile(rf"(?:\^\(\?=\^?|\(\?=\^){_LENGTH}\$\)(.*)", re.S)
_LENGTH_LAST = re.compile(rf"\^?\(\?=\^?(.*\$)\){_LENGTH}\$", re.S)


def lengths_from_lookahead(pattern: str) -> tuple[str, int, int] | None:
    """`^(?=.{m,n}$)R` -> ("^R", m, n) and `^(?=^P$).{m,n}$` -> ("^P$", m, n): the pattern left and the length
    bounds the lookahead states; written with `.`, the pattern also leaves newlines out (`pattern_without`).
    None for any other pattern, or when the newline cannot be left out."""
    if m := _LENGTH_FIRST.fullmatch(pattern):
        any_char, low, high, rest = m.groups()
    elif m := _LENGTH_LAST.fullmatch(pattern):
        rest, any_char, low, high = m.groups()
    else:
        return None
    if regex_shape(rest) is None:  # the lookahead's end was misread
        return None
    rest = without_negative_lookaheads("^" + rest.removeprefix("^"))
    if rest is not None and any_char == ".":
        rest = pattern_without(rest, {"\n"})
    return None if rest is None else (rest, int(low), int(high))


def class_text(chars: CharSet) -> str | None:
    """A regex class for `chars`, runs as ranges (None when empty or beyond \\uFFFF)."""
    points = sorted(map(ord, chars.chars))
    if (not points and not chars.negated) or any(c > 0xFFFF for c in points):
        return None
    runs: list[list[int]] = []
    for c in points:
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    spelled = "".join(f"\\u{a:04x}" + (f"-\\u{b:04x}" if b > a else "") for a, b in runs)
    return ("[^" if chars.negated else "[") + spelled + "]"


def class_outside(chars: CharSet) -> str | None:
    """A regex character class matching what `chars` does not (None when not expressible)."""
    return None if chars.negated else class_text(CharSet(chars.chars, True))


def fold_lengths_into_pattern(kw: dict) -> None:
    """A string schema's `kw` (pattern, minLength, maxLength): the pattern anchored (narrower), drop the bounds
    every match meets;
    `^PX*$`/`^PX+$` (P: no top-level `|`, X: one character or class) plus bounds -> `^PX{m,n}$`,
    counted for P's extremes (narrower), at most MAX_FOLDED_REPEAT."""
    shape = regex_shape(kw["pattern"])
    if shape is None:
        return
    if not shape.anchored_end and ("minLength" in kw or "maxLength" in kw):
        # full matches only, as xgrammar reads every pattern (llguidance would search, and the bounds then count)
        kw["pattern"] = f"^(?:{kw['pattern']})$"
    if kw.get("minLength", 0) <= shape.min_len:
        kw.pop("minLength", None)
    if "maxLength" in kw and shape.max_len <= kw["maxLength"]:
        kw.pop("maxLength")
    m = _TAIL_STAR_PATTERN.fullmatch(kw["pattern"])
    if not m or ("minLength" not in kw and "maxLength" not in kw):
        return
    prefix, atom, plus = m.group(1), m.group(2), m.group(3) == "+"
    if len(atom) > MAX_FOLDED_CLASS:  # xgrammar 0.2.9 lets a '"' through a wide class repeated {0,1000}
        return
    try:
        parsed = sre_parse.parse(prefix)
        p_low, p_high = parsed.getwidth()
    except (re.error, OverflowError, RecursionError):
        return
    if any(op is sre_parse.BRANCH for op, _ in parsed):
        return
    lo = max(kw.get("minLength", 0) - p_low, 1 if plus else 0)
    hi = ""
    if "maxLength" in kw:
        if p_high >= sre_parse.MAXREPEAT:
            return
        hi = min(kw["maxLength"] - p_high, lo + MAX_FOLDED_REPEAT)
        if hi < lo:
            return
    kw.pop("minLength", None)
    kw.pop("maxLength", None)
    kw["pattern"] = f"^{prefix}{atom}{{{lo},{hi}}}$"
