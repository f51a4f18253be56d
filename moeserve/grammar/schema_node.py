"""One plain schema node (no `$ref`/`allOf`/`anyOf`/`oneOf`/`enum` at its top), keyword by keyword.

Each keyword is kept in a form xgrammar enforces exactly, rewritten to one, dropped where it cannot
constrain what the node produces, kept as written for llguidance (`nz.keep`), or refused with a
GrammarError naming it; tests/grammar/test_schema_support.py measures xgrammar 0.2.9 on each.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from moeserve.grammar.errors import GrammarError
from moeserve.grammar.formats import FORMAT_PATTERNS, SUPPORTED_FORMATS, UNSUPPORTED_FORMATS
from moeserve.grammar.regex_compat import xgrammar_regex
from moeserve.grammar.regex_rewrite import (
    fold_lengths_into_pattern,
    lengths_from_lookahead,
    without_negative_lookaheads,
)
from moeserve.grammar.schema_keys import fresh_properties, lengths_into_patterns, pattern_keys, property_names
from moeserve.grammar.schema_merge import ALL_TYPES, listed, type_set

if TYPE_CHECKING:
    from moeserve.grammar.schema_support import SchemaNormalizer

_KEYWORDS_OF = {
    "object": ("properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
               "maxProperties", "unevaluatedProperties", "dependencies", "dependentRequired", "dependentSchemas"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}  # fmt: skip
_JSON_TYPES = {bool: "boolean", type(None): "null", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def json_type(v: Any) -> str:  # of a parsed JSON value
    return _JSON_TYPES[type(v)]


def inferred_types(s: dict) -> set[str]:
    """Types whose keywords appear in `s` ("number" stands for integer too)."""
    return {t for t, kws in _KEYWORDS_OF.items() if any(k in s for k in kws)}


def produced_types(s: dict) -> set[str]:
    """JSON types a (fixed) node can produce once normalized: declared, listed, or inferred."""
    if listed(s) is not None:
        return {json_type(v) for v in listed(s)}
    return type_set(s) or inferred_types(s) or set(ALL_TYPES)


def normalize_node(nz: SchemaNormalizer, s: dict) -> Any:
    """The normalized form of plain node `s` (see module docstring)."""
    rest = dict(s)
    _narrow_not(rest)
    _refuse_logic(rest)
    # Without `type`, xgrammar ignores e.g. `minimum` and lets any JSON through, while a validator
    # applies it to numbers. Restricting to the types whose keywords appear is narrower, so sound.
    types = type_set(rest) or inferred_types(rest)
    rest.pop("type", None)
    out: dict[str, Any] = {}
    _numbers(rest, types, out, nz.keep)
    _strings(rest, types, out, nz.keep)
    _arrays(nz, rest, types, out)
    if not _objects(nz, rest, types, out):  # a required property no value satisfies, or none allowed: no object
        types = types - {"object"}
        if not types:
            return False
    if types:
        ordered = [t for t in ALL_TYPES if t in types]
        out = {"type": ordered[0] if len(ordered) == 1 else ordered, **out}
    for key in ("then", "else", "minContains", "maxContains"):  # inert without if / contains
        rest.pop(key, None)
    if rest:
        key = sorted(rest)[0]
        raise GrammarError(f"JSON-Schema keyword {key!r} is not supported", feature=key)
    return out


def _narrow_not(s: dict) -> None:
    """not {type: T}: the other types (exact). Other `not` forms are narrowed earlier (negation) or refused."""
    neg = s.get("not")
    if not isinstance(neg, dict) or set(neg) != {"type"}:
        return
    excluded = type_set(neg) | ({"integer"} if "number" in type_set(neg) else set())
    allowed = type_set(s) or set(ALL_TYPES)
    if "integer" in excluded and "number" in allowed - excluded:
        return  # "number but not integer" has no grammar here
    allowed -= excluded
    if allowed:
        s["type"] = [t for t in ALL_TYPES if t in allowed]
        del s["not"]


def _refuse_logic(s: dict) -> None:
    """Keywords xgrammar ignores and we cannot rewrite (`if` and dependencies that `prep` did not rewrite)."""
    if "not" in s:
        raise GrammarError.refused("not", "negated schemas are not supported")
    for key in ("if", "$dynamicRef", "$recursiveRef", "dependencies", "dependentRequired", "dependentSchemas"):
        if key in s:
            raise GrammarError.refused(key, "not supported here")


def _numbers(s: dict, types: set[str], out: dict, keep: frozenset[str]) -> None:
    kw = {k: s.pop(k) for k in _KEYWORDS_OF["number"] if k in s}
    if not types & {"integer", "number"}:
        return
    step = kw.pop("multipleOf", None)
    if step is not None:
        # xgrammar enforces multipleOf only for integers ("not supported for type:number; ignoring").
        if ("number" in types or float(step) != int(step)) and "multipleOf" not in keep:
            raise GrammarError.refused("multipleOf", "multipleOf is enforced only on integer types with a whole-number step")
        out["multipleOf"] = int(step) if float(step) == int(step) else step
    if "number" in types:
        out.update(kw)
        return
    # Integers only: xgrammar wants whole-number bounds, so turn every bound into an inclusive one.
    lows = [math.ceil(kw["minimum"])] if "minimum" in kw else []
    highs = [math.floor(kw["maximum"])] if "maximum" in kw else []
    if "exclusiveMinimum" in kw:
        lows.append(math.floor(kw["exclusiveMinimum"]) + 1)
    if "exclusiveMaximum" in kw:
        highs.append(math.ceil(kw["exclusiveMaximum"]) - 1)
    if lows:
        out["minimum"] = max(lows)
    if highs:
        out["maximum"] = min(highs)


def _strings(s: dict, types: set[str], out: dict, keep: frozenset[str]) -> None:  # keep: combinations llguidance takes
    kw = {k: s.pop(k) for k in _KEYWORDS_OF["string"] if k in s}
    if "string" not in types:
        return
    if kw.get("minLength") == 0:
        del kw["minLength"]
    fmt = kw.pop("format", None)
    if fmt in UNSUPPORTED_FORMATS:
        raise GrammarError.refused(f"format:{fmt}", f"format {fmt!r} is not supported")
    if fmt in FORMAT_PATTERNS:
        if "pattern" in kw:
            if "format+pattern" not in keep:
                raise GrammarError.refused("format+pattern", "combining format and pattern on one string is not supported")
            return out.update(kw, format=fmt)
        kw["pattern"] = FORMAT_PATTERNS[fmt]
    elif fmt in SUPPORTED_FORMATS:
        kw["format"] = fmt
    # Unknown formats (int32, non-blank, ...) are annotations: validators ignore them, so do we.
    if "pattern" in kw:
        # lookarounds go before either backend sees the pattern
        if (stated := lengths_from_lookahead(kw["pattern"])) is not None:
            kw["pattern"], low, high = stated
            kw["minLength"], kw["maxLength"] = max(kw.get("minLength", 0), low), min(kw.get("maxLength", high), high)
        elif (narrowed := without_negative_lookaheads(kw["pattern"])) is not None:
            kw["pattern"] = narrowed
        fold_lengths_into_pattern(kw)
    kinds = sorted({"length" if k.endswith("Length") else k for k in kw})
    if len(kinds) > 1:
        # xgrammar keeps only one of format / pattern / length and silently drops the others.
        if "+".join(kinds) not in keep:
            raise GrammarError.refused("+".join(kinds), "combining format, pattern and minLength/maxLength on one string is not supported")
        return out.update(kw)
    if "pattern" in kw:
        kw["pattern"] = xgrammar_regex(kw["pattern"], dot_excludes_newline=False)
    out.update(kw)


def _arrays(nz: SchemaNormalizer, s: dict, types: set[str], out: dict) -> None:
    kw = {k: s.pop(k) for k in _KEYWORDS_OF["array"] if k in s}
    if "array" not in types:
        return
    if kw.get("uniqueItems") is True and kw.get("maxItems", 2) > 1:
        if kw.get("minItems", 0) > 1:
            raise GrammarError.refused("uniqueItems", "unique array items are not supported (with minItems > 1)")
        kw["maxItems"] = 1  # narrower: an array of at most one item is unique
    items = kw.get("items", kw.get("unevaluatedItems"))  # with no adjacent applicator they mean the same
    prefix = kw.get("prefixItems") or []
    if "contains" in kw:
        prefix, items = nz.contains_first(kw, prefix, items)
    if prefix:
        out["prefixItems"] = [nz.norm(x) for x in prefix]
    if items is not None:
        out["items"] = nz.norm(items)
    elif not prefix or kw.get("minItems", 0) > len(prefix):
        out["items"] = True  # xgrammar's strict mode would otherwise allow no items beyond prefixItems
    out.update({k: kw[k] for k in ("minItems", "maxItems") if k in kw})


def _objects(nz: SchemaNormalizer, s: dict, types: set[str], out: dict) -> bool:
    """Object keywords into `out`; False when no object satisfies them (nothing written)."""
    kw = {k: s.pop(k) for k in _KEYWORDS_OF["object"] if k in s}
    if "object" not in types:
        return True
    required = list(kw.get("required", []))
    extra = kw.get("additionalProperties", kw.get("unevaluatedProperties"))  # None: absent
    names = kw.get("propertyNames")
    declared = dict(kw.get("properties") or {})
    patterns = kw.get("patternProperties") or {}
    if patterns:
        if names is not None:  # narrower: keys the patterns match and the names' length bounds allow
            patterns, names, extra = lengths_into_patterns(nz, patterns, names, declared), None, False
        patterns = pattern_keys(nz, patterns, declared, required)
        if not patterns:
            extra = False  # narrower: declared properties only
    props: dict[str, Any] = {}
    for name, sub in declared.items():
        n = nz.norm(sub)
        if n is False:
            if name in required:
                return False
            if extra not in (None, False):
                raise GrammarError.refused("properties", f"property {name!r} is false while additionalProperties allows others")
            continue  # in strict mode an undeclared name is never produced
        props[name] = n
    for name in required:
        if name in props:
            continue
        if names is not None:  # (a name a pattern matches is declared by now; others fall under additionalProperties)
            raise GrammarError.refused("required", f"required property {name!r} is not declared in properties (next to propertyNames)")
        if extra is False:
            return False  # required, yet forbidden by additionalProperties: false
        props[name] = nz.norm(extra) if isinstance(extra, dict) else True
    min_props = kw.get("minProperties", 0)
    if min_props > len(props) and names is not None and extra is not False and "minProperties" not in nz.keep:
        props.update(fresh_properties(nz, min_props - len(props), props, names, extra))  # (llguidance: no propertyNames)
    if min_props > max(len(required), 1) and "minProperties" not in nz.keep:
        # xgrammar counts entries, and undeclared keys may repeat ({"b":1,"b":2} is one property once
        # parsed): one entry is one property, but past one only distinct declared properties can be trusted.
        if min_props > len(props):  # (llguidance counts distinct keys)
            raise GrammarError.refused("minProperties", f"minProperties {min_props} needs undeclared properties; duplicate keys could fake it")
        extra, patterns, names = False, {}, None  # narrower: declared properties only
    if patterns:
        out["patternProperties"] = patterns
        extra = None  # xgrammar ignores additionalProperties next to patternProperties: narrower, sound
    if names is not None:
        property_names(nz, names, props, out)
    if props or "properties" in kw:
        out["properties"] = props
    if required:
        out["required"] = required
    out.update({k: kw[k] for k in ("minProperties", "maxProperties") if k in kw})
    if extra is not None:
        out["additionalProperties"] = extra if isinstance(extra, bool) else nz.norm(extra)
    return True
