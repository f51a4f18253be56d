"""ECMA-262 Unicode property escapes (`\\p{L}`, `\\P{Cc}`, `\\p{ASCII}`) in a schema's patterns, spelled out as the
code point ranges Python's `re` reads, so the rest of the layer judges and narrows them as any other class.

JSON Schema patterns are ECMA-262 regexes; many real schemas (AWS resource schemas, for one) write Unicode
property classes, which Python's `re` rejects. A general category (`L`, `Lu`, `Letter`, `gc=Nd`, ...), `ASCII`
and `Any` are read exactly, by this Python's Unicode tables; other properties (scripts, Java's `Graph`) are left
as written, which `re` then refuses as an invalid pattern.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
from typing import Any

_ESCAPE = re.compile(r"\\\\|\\([pP])\{([A-Za-z_=]+)\}")
_LONG_NAMES = {
    "Letter": "L", "Cased_Letter": "LC", "Uppercase_Letter": "Lu", "Lowercase_Letter": "Ll", "Titlecase_Letter": "Lt",
    "Modifier_Letter": "Lm", "Other_Letter": "Lo", "Mark": "M", "Nonspacing_Mark": "Mn", "Spacing_Mark": "Mc",
    "Enclosing_Mark": "Me", "Number": "N", "Decimal_Number": "Nd", "Letter_Number": "Nl", "Other_Number": "No",
    "Punctuation": "P", "Connector_Punctuation": "Pc", "Dash_Punctuation": "Pd", "Open_Punctuation": "Ps",
    "Close_Punctuation": "Pe", "Initial_Punctuation": "Pi", "Final_Punctuation": "Pf", "Other_Punctuation": "Po",
    "Symbol": "S", "Math_Symbol": "Sm", "Currency_Symbol": "Sc", "Modifier_Symbol": "Sk", "Other_Symbol": "So",
    "Separator": "Z", "Space_Separator": "Zs", "Line_Separator": "Zl", "Paragraph_Separator": "Zp", "Other": "C",
    "Control": "Cc", "Format": "Cf", "Surrogate": "Cs", "Private_Use": "Co", "Unassigned": "Cn",
}


def with_python_patterns(schema: Any) -> Any:
    """`schema` with the property escapes of every `pattern` and `patternProperties` key spelled out (a copy
    where any changes; values under enum, const, default and examples are data, left alone)."""
    if isinstance(schema, list):
        return [with_python_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples"):
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = python_pattern(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {python_pattern(k): with_python_patterns(v) for k, v in value.items()}
        else:
            out[key] = with_python_patterns(value)
    return out


def python_pattern(pattern: str) -> str:
    """`pattern` with each `\\p{X}` / `\\P{X}` of a known property as explicit ranges (inside a class, the ranges
    alone; outside, a class of them)."""
    if "\\p{" not in pattern and "\\P{" not in pattern:
        return pattern
    out, depth, i = [], 0, 0
    while i < len(pattern):
        m = _ESCAPE.match(pattern, i)
        if m and m.group(1) and (ranges := _ranges(m.group(2), m.group(1) == "P")) is not None:
            out.append(ranges if depth else f"[{ranges}]")
            i = m.end()
            continue
        ch = pattern[i : i + 2] if pattern[i] == "\\" else pattern[i]
        if ch == "[":
            depth += 1
        elif ch == "]" and depth and pattern[i - 1] != "[" and pattern[i - 2 : i] != "[^":
            depth -= 1
        out.append(ch)
        i += len(ch)
    return "".join(out)


@functools.lru_cache(maxsize=64)
def _ranges(name: str, negated: bool) -> str | None:
    """Class text (no brackets) for property `name`, or its complement; None for a property not known here."""
    name = name.removeprefix("General_Category=").removeprefix("gc=")
    name = _LONG_NAMES.get(name, name)
    if name in ("ASCII", "Any"):
        runs = [(0, 0x7F if name == "ASCII" else sys.maxunicode)]
    elif name == "LC" or re.fullmatch(r"[LMNPSZC][a-z]?", name):
        wanted = ("Lu", "Ll", "Lt") if name == "LC" else (name,)
        runs = [(a, b) for a, b, cat in _category_runs() if cat.startswith(wanted)]
    else:
        return None
    if negated:
        gaps, start = [], 0
        for a, b in [*runs, (sys.maxunicode + 1, sys.maxunicode + 1)]:
            if a > start:
                gaps.append((start, a - 1))
            start = b + 1
        runs = gaps
    return "".join(_spell(a) + (f"-{_spell(b)}" if b > a else "") for a, b in runs)


@functools.lru_cache(maxsize=1)
def _category_runs() -> list[tuple[int, int, str]]:
    """Every code point in runs of one general category: (first, last, category)."""
    runs: list[list] = []
    for c in range(sys.maxunicode + 1):
        cat = unicodedata.category(chr(c))
        if runs and runs[-1][2] == cat:
            runs[-1][1] = c
        else:
            runs.append([c, c, cat])
    return [tuple(r) for r in runs]


def _spell(c: int) -> str:
    return f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"
