"""Intersection of two JSON schemas, for `allOf` and for siblings of `anyOf`/`oneOf`/`$ref`.

xgrammar enforces neither several `allOf` branches nor those siblings, so "A and B" is rewritten
into one schema that says both. The merge is exact or it refuses with a GrammarError naming the
keyword (different patterns, `additionalProperties` that would forbid the other side's properties).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from moeserve.grammar.errors import GrammarError
from moeserve.grammar.regex_facts import finite_language, full_matches_never_search, key_matches, regex_shape

Schema = Any  # dict | bool, as parsed from JSON
Prep = Callable[[Schema], Schema]  # resolves $ref / allOf / draft quirks at the top of a subschema
Merge = Callable[[Schema, Schema], Schema]

_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_NOTHING = object()  # a keyword pair no instance satisfies
MAX_CROSS = 64  # anyOf x anyOf expands to at most this many branches
ALL_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_REFUSED_ANYWAY = {
    "if": "if/then/else", "then": "if/then/else", "else": "if/then/else",
    "contains": "contains", "$dynamicRef": "$dynamicRef",
    "$recursiveRef": "$recursiveRef",
}  # fmt: skip


def json_key(value: Any) -> Any:
    """A hashable key with JSON equality: 1 == 1.0, but True != 1 and "1" != 1."""
    if isinstance(value, bool) or value is None:
        return ("c", value)
    if isinstance(value, (int, float)):
        return ("n", Fraction(value) if math.isfinite(value) else value)
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("l", tuple(json_key(v) for v in value))
    if isinstance(value, dict):
        return ("d", frozenset((k, json_key(v)) for k, v in value.items()))
    raise TypeError(f"not a JSON value: {value!r}")


def type_set(schema: dict) -> set[str] | None:
    """The `type` keyword as a set, or None when absent (any type)."""
    t = schema.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def listed(schema: dict) -> list | None:
    """The values `enum`/`const` allow (`const` first), or None when the schema lists none."""
    return [schema["const"]] if "const" in schema else schema.get("enum")


def merge_schemas(a: Schema, b: Schema, prep: Prep, merge: Merge) -> Schema:
    """The schema of instances valid under both `a` and `b` (both `prep`ped); nested subschemas
    are `prep`ped and merged with `merge` (which lets the caller track them)."""
    if a is True or b is True:
        return b if a is True else a
    if a is False or b is False:
        return False
    out = dict(a)
    if "pattern" in a and "pattern" in b and a["pattern"] != b["pattern"]:
        both = _pattern_intersection(a["pattern"], b["pattern"])
        if both is not None:
            if not both:
                return False
            out["enum"] = [v for v in out.get("enum", both) if v in both]
            del out["pattern"]
            b = {k: v for k, v in b.items() if k != "pattern"}
    if "properties" in a or "properties" in b:
        out["properties"] = _merge_properties(a, b, prep, merge)
    if a.get("patternProperties") or b.get("patternProperties"):
        out["patternProperties"] = _merge_patterns(a, b, prep, merge)
    for key, vb in b.items():
        if key in ("properties", "patternProperties") and key in out:
            continue
        if key not in out:
            out[key] = vb
        elif json_key(out[key]) != json_key(vb):
            out[key] = _merge_keyword(key, out[key], vb, prep, merge)
            if out[key] is _NOTHING:
                return False  # no instance satisfies both; anyOf drops such a branch
    if any(out.get("properties", {}).get(name) is False for name in out.get("required", [])):
        return False  # a required property no value satisfies
    return out


def _pattern_intersection(p: str, q: str) -> list[str] | None:
    """Strings matching both patterns where decidable: [] when none can, the few full matches of
    an anchored pattern that the other matches too (narrower: no final newline), else None."""
    if full_matches_never_search(p, q) and full_matches_never_search(q, p) and _starts_anchored(p) and _starts_anchored(q):
        return []
    for mine, theirs in ((p, q), (q, p)):
        language = finite_language(mine) if _starts_anchored(mine) else None
        both = [s for s in language or () if re.search(theirs, s)]
        if both:
            return both
    return None


def _starts_anchored(pattern: str) -> bool:
    shape = regex_shape(pattern)
    return shape is not None and shape.anchored and shape.anchored_end and shape.min_len > 0


def _merge_keyword(key: str, va: Any, vb: Any, prep: Prep, merge: Merge) -> Any:
    if key == "type":
        return _merge_types(va, vb)
    if key == "required":
        return list(dict.fromkeys([*va, *vb]))
    if key in ("items", "additionalProperties", "propertyNames") and not isinstance(va, list) and not isinstance(vb, list):
        return merge(prep(va), prep(vb))
    if key == "enum":
        keys_b = {json_key(v) for v in vb}
        return [v for v in va if json_key(v) in keys_b] or _NOTHING
    if key == "const":
        return _NOTHING
    if key in _LOWER_BOUNDS:
        return max(va, vb)
    if key in _UPPER_BOUNDS:
        return min(va, vb)
    if key == "multipleOf" and all(isinstance(v, int) and not isinstance(v, bool) for v in (va, vb)):
        return va * vb // math.gcd(va, vb)
    if key == "dependentRequired":
        return {n: list(dict.fromkeys([*va.get(n, []), *vb.get(n, [])])) for n in dict.fromkeys([*va, *vb])}
    if key == "dependentSchemas":
        return {n: {"allOf": [va[n], vb[n]]} if n in va and n in vb else va.get(n, vb.get(n)) for n in dict.fromkeys([*va, *vb])}
    if key == "not":  # not A and not B == not (A or B)
        return {"anyOf": [va, vb]}
    if key == "uniqueItems":
        return bool(va or vb)
    if key == "anyOf" and len(va) * len(vb) <= MAX_CROSS:
        # (A1 or A2) and (B1 or B2) == (A1 and B1) or (A1 and B2) or ...
        return [merge(prep(x), prep(y)) for x in va for y in vb]
    if key in _REFUSED_ANYWAY:  # the node will refuse the keyword itself; name it, not allOf
        raise GrammarError(f"{key}: not supported (met while combining allOf branches)", feature=_REFUSED_ANYWAY[key])
    raise GrammarError(
        f"allOf (or keywords beside anyOf/oneOf/$ref) combines two different {key!r} values; "
        "this server cannot enforce both at once",
        feature=f"allOf:{key}",
    )


def _merge_types(va: Any, vb: Any) -> Any:
    ta = {va} if isinstance(va, str) else set(va)
    tb = {vb} if isinstance(vb, str) else set(vb)
    both = ta & tb
    # integer is a subtype of number: {number} & {integer} = {integer}
    if "number" in ta and "integer" in tb or "number" in tb and "integer" in ta:
        both.add("integer")
    if not both:
        return _NOTHING
    kept = [t for t in ALL_TYPES if t in both]
    return kept[0] if len(kept) == 1 else kept


def _merge_properties(a: dict, b: dict, prep: Prep, merge: Merge) -> dict:
    """Property-wise intersection; an undeclared name falls under that side's matching
    patternProperties, else its additionalProperties."""
    out = {}
    for name in dict.fromkeys([*a.get("properties", {}), *b.get("properties", {})]):
        out[name] = merge(_property_schema(a, name, prep, merge), _property_schema(b, name, prep, merge))
    return out


def _property_schema(s: dict, name: str, prep: Prep, merge: Merge) -> Schema:
    """What object schema `s` requires of the value of property `name`."""
    if name in s.get("properties", {}):
        return prep(s["properties"][name])
    hits = [prep(sub) for pattern, sub in (s.get("patternProperties") or {}).items() if key_matches(pattern, name)]
    if not hits:
        return prep(s.get("additionalProperties", True))
    out = hits[0]
    for hit in hits[1:]:
        out = merge(out, hit)
    return out


def _merge_patterns(a: dict, b: dict, prep: Prep, merge: Merge) -> dict:
    """Both sides' patternProperties, each merged with the other side's additionalProperties
    (narrower where a key also matches the other side's patterns, which keep their own entries)."""
    out: dict = {}
    for mine, other in ((a, b), (b, a)):
        rest = prep(other.get("additionalProperties", True))
        for pattern, sub in (mine.get("patternProperties") or {}).items():
            value = merge(prep(sub), rest)
            out[pattern] = merge(out[pattern], value) if pattern in out else value
    return out
