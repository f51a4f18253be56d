"""Regexes as validators read them, rewritten so xgrammar 0.2.9 matches no more than that.

A `pattern` or `guided_regex` is judged by Python's `re`. Measured against it, xgrammar is mostly
narrower (ASCII `\\d`, `\\w`: safe) but wider in places: `.` matches a newline in `guided_regex`;
`\\s` matches U+FEFF and `\\S`/`[^\\s]` match U+0085 and U+001C-U+001F; `\\D`, `\\W`, `[^\\d]`,
`[^\\w]` match non-ASCII digits and letters; and in a pattern, `^a(b[01]+)?$` accepts "a0" (an
optional group loses its leading literal); it ignores lookarounds and reads `\\u` escapes only.
`xgrammar_regex` spells whitespace classes out, reduces classes with other shorthands to the printable
ASCII characters Python says they match and classes reaching past U+FFFF to their BMP part, rewrites `.`
to `[^\\n]` and `)?` to `){0,1}`, makes negative lookaheads hold by construction
(`regex_rewrite.without_negative_lookaheads`) and refuses other lookarounds.
"""

from __future__ import annotations

import functools
import re

from moeserve.grammar.errors import GrammarError
from moeserve.grammar.regex_facts import CharSet
from moeserve.grammar.regex_rewrite import class_end, class_text, lookarounds, without_negative_lookaheads

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
    if lookarounds(pattern):  # xgrammar ignores lookarounds: each one has to hold by construction, or no pattern
        narrowed = without_negative_lookaheads(pattern)
        if narrowed is None:
            raise GrammarError.refused("lookaround", f"pattern {pattern!r}: a lookaround that is not a negative "
                                                     "lookahead needing some character is not supported")
        pattern = narrowed
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
            elif esc == "\\U":  # xgrammar would read "U" and then the digits
                point = int(pattern[i + 2 : i + 10], 16)
                if point > 0xFFFF:
                    raise GrammarError.refused("pattern", f"{pattern[i : i + 10]}: characters past U+FFFF are not supported")
                out.append(f"\\u{point:04x}")
                i += 8
            else:
                out.append(esc)
            i += 2
        elif ch == "[":
            end = class_end(pattern, i)
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


def _rewrite_class(text: str) -> str:
    negated = text.startswith("[^")
    body = text[2:-1] if negated else text[1:-1]
    if "\\U" in body:  # beyond the BMP (a spelled-out property class): xgrammar reads \uXXXX only
        return _bmp_class(text)
    shorthands = set(re.findall(r"\\([sSdDwW])", body))
    if not shorthands:
        return "[" + ("^" if negated else "") + _spelled(body) + "]"  # raw control characters spelled out
    if shorthands <= {"s"} or (shorthands <= {"s", "d", "w"} and not negated):
        return "[" + ("^" if negated else "") + body.replace("\\s", _spelled(WS_ANY if negated else WS_BOTH)) + "]"
    # Anything else: the printable ASCII characters Python says the class matches (narrower, exact there).
    members = [c for c in _PRINTABLE if re.fullmatch(text, c)]
    if not members:
        raise GrammarError(f"character class {text!r} matches no printable ASCII character", feature="pattern")
    return "[" + "".join("\\" + c if c in "\\]^-[" else c for c in members) + "]"


@functools.lru_cache(maxsize=256)
def _bmp_class(text: str) -> str:
    """The class of the BMP characters (surrogates aside) `text` matches: narrower, exact there."""
    matches = re.compile(text).fullmatch
    members = frozenset(chr(c) for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF and matches(chr(c)))
    spelled = class_text(CharSet(members))
    if spelled is None:
        raise GrammarError(f"character class {text[:80]!r} matches no character below U+10000", feature="pattern")
    return spelled
