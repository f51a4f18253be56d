"""Disjointness: proving one subschema rejects all another produces, and narrowing one until it does.

`excludes` proves it; `exclude_all` narrows a subschema until every other rejects it (overlapping
`oneOf` branches, `not`, the `else` of an `if`); `exclusive` makes `oneOf` an `anyOf` of branches that
exclude each other. Proofs use only facts that survive later merges with sibling keywords (a property
declared false, or additionalProperties false).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from moeserve.grammar.errors import GrammarError
from moeserve.grammar.regex_facts import finite_language, full_matches_never_search, key_matches, regex_shape
from moeserve.grammar.regex_rewrite import class_outside, pattern_without
from moeserve.grammar.schema_merge import ALL_TYPES, listed, type_set
from moeserve.grammar.schema_node import json_type, produced_types

if TYPE_CHECKING:
    from moeserve.grammar.schema_support import SchemaNormalizer as _Base
else:
    _Base = object

Schema = Any


class Exclusion(_Base):
    """The disjointness half of SchemaNormalizer's narrowings (it supplies deref, fixed, parts, accepts)."""

    def exclusive(self, branches: list[Schema]) -> list[Schema]:
        """oneOf == anyOf over branches that each provably exclude every other; a branch that does
        not is narrowed until it does (exclude_all), or left out."""
        kept, first_overlap = [], None
        for i, bi in enumerate(branches):
            others = [bj for j, bj in enumerate(branches) if j != i]
            narrowed = self.exclude_all(bi, others)
            if narrowed is not None:
                kept.append(narrowed)
            elif first_overlap is None:
                first_overlap = (i, next(j for j, bj in enumerate(branches) if j != i and not self.excludes(bi, bj)))
        if not kept and self.one_of_as_any_of:  # opt-in: may match two branches (GrammarSection.one_of)
            return branches
        if not kept:
            i, j = first_overlap
            raise GrammarError(f"oneOf: branch {i} may also match branch {j}; only oneOf with provably disjoint branches "
                               "(different types or enum values, a const discriminator property, or a property one "
                               "branch requires and the other never produces) is supported", feature="oneOf")
        return kept

    def exclude_all(self, gen: Schema, others: list[Schema], depth: int = 0) -> Schema | None:
        """`gen`, or a narrowing of it, that every one of `others` rejects; None if not found."""
        if all(self.excludes(gen, o) for o in others):
            return gen
        gen, others = self.deref(gen), self._alternatives(others)
        if isinstance(gen, dict) and len(gen) == 1 and set(gen) <= {"anyOf", "oneOf"} and depth < 4:  # each branch on its own
            (key, branches), = gen.items()
            kept = [b for b in (self.exclude_all(b, others, depth + 1) for b in branches) if b is not None]
            narrowed = {key: kept} if kept else None
        elif not isinstance(gen, dict) or any(k in gen for k in ("anyOf", "oneOf", "not", "if")):
            return None
        elif (left := self._types_left(gen, others)) is not None:
            narrowed = {**gen, "type": left}
        elif listed(gen) is not None:
            kept = [v for v in listed(gen) if self.accepts(gen, v) and not any(self.accepts(o, v) for o in others)]
            narrowed = {"enum": kept} if kept else None
        elif (types := produced_types(gen)) == {"object"}:
            narrowed = self._exclude_by_properties(gen, others)
        elif types <= {"string"} and all("pattern" in o for o in map(self.deref, others) if isinstance(o, dict)):
            narrowed = self._exclude_patterns(gen, others)
        elif types <= {"string"} or types <= {"integer", "number"}:
            narrowed = self._exclude_values(gen, types, others)
        else:
            return None
        if narrowed is None:
            return None
        narrowed = self.fixed(narrowed, self.parts(gen) + [narrowed])
        return narrowed if all(self.excludes(narrowed, o) for o in others) else None

    def _types_left(self, gen: dict, others: list[Schema]) -> list[str] | None:
        """`gen`'s types less those any of `others` allows, when that leaves some and every other names
        its types ({"type": ["string", "null"]} against {"type": ["number", "null"]}: string)."""
        mine = type_set(gen) if "type" in gen else None
        theirs = [type_set(o) if isinstance(o, dict) else None for o in map(self.deref, others)]
        if mine is None or any(t is None for t in theirs):
            return None
        left = {t for t in mine if not any(_types_overlap({t}, allowed) for allowed in theirs)}
        return [t for t in ALL_TYPES if t in left] if left and left != mine else None

    def _alternatives(self, schemas: list[Schema], depth: int = 0) -> list[Schema]:
        """`schemas` with each union (anyOf / oneOf) replaced by its branches: what every branch rejects,
        the union rejects (whatever its sibling keywords)."""
        out = []
        for s in map(self.deref, schemas):
            union = s.get("anyOf", s.get("oneOf")) if isinstance(s, dict) and depth < 4 else None
            out += [s] if union is None else self._alternatives(union, depth + 1)
        return out

    def _exclude_by_properties(self, gen: dict, others: list[Schema]) -> dict | None:
        """Object `gen` narrowed so that each of `others` rejects it: a property whose values the
        other rejects becomes required, or one the other requires is never produced."""
        props, required = dict(gen.get("properties", {})), list(gen.get("required", []))
        for other in others:
            if self.excludes(gen, other):
                continue
            other = self.deref(other)
            if not isinstance(other, dict):
                return None
            theirs = other.get("properties", {})
            key = next((n for n, sub in props.items() if n in theirs and self.excludes(sub, theirs[n])
                        and self.deref(sub) is not False), None)
            if key is None:
                key = next((n for n, sub in props.items() if n in theirs and self._rejected_values(sub, theirs[n])), None)
                if key is not None:
                    props[key] = self.fixed({"enum": self._rejected_values(props[key], theirs[key])}, self.parts(self.deref(props[key])))
            if key is None:  # a string or number property both declare, narrowed until `other`'s rejects it
                key = next((n for n, sub in props.items() if n in theirs and isinstance(self.deref(sub), dict)
                            and produced_types(self.deref(sub)) <= {"string", "integer", "number"}
                            and (narrowed := self.exclude_all(sub, [theirs[n]])) is not None), None)
                if key is not None:
                    props[key] = narrowed
            if key is None:  # a name `other` forbids (propertyNames, a false patternProperty)
                key = next((n for n in self._name_candidates(gen, other) if self._forbids_name(other, n)
                            and _may_produce({**gen, "properties": props}, n)), None)
            if key is not None:
                required.append(key)
                continue
            names = [n for n in other.get("required", []) if n not in required]
            patterns = gen.get("patternProperties") or {}
            if not names or "minProperties" in gen or any(finite_language(p) is None for p in patterns):
                return None  # (a false property next to patterns that may produce it anyway cannot be compiled)
            if gen.get("additionalProperties", False) is not False:
                if not set(required) <= set(props):
                    return None
                gen = {**gen, "additionalProperties": False}  # narrower: declared properties only
            props[names[-1]] = False  # never produced, whatever is merged in later
        return {**gen, "properties": props, "required": list(dict.fromkeys(required))}

    def _name_candidates(self, gen: dict, other: dict) -> list[str]:
        """Property names worth trying against `other`'s name rules (named by either side)."""
        names = [*gen.get("properties", {}), *gen.get("required", [])]
        for pattern in [*(gen.get("patternProperties") or {}), *(other.get("patternProperties") or {})]:
            names += finite_language(pattern) or []
        rule = self.deref(other.get("propertyNames", True))
        if isinstance(rule, dict) and isinstance(self.deref(rule.get("not", True)), dict):
            names += [v for v in listed(self.deref(rule["not"])) or [] if isinstance(v, str)]
        return list(dict.fromkeys(names))

    def _forbids_name(self, other: dict, name: str) -> bool:
        """Does `other` reject every object that has property `name`?"""
        if "propertyNames" in other and not self.validator.evolve(schema=other["propertyNames"]).is_valid(name):
            return True
        patterns = other.get("patternProperties") or {}
        if other.get("additionalProperties") is False and name not in other.get("properties", {}) \
                and not any(key_matches(p, name) for p in patterns):
            return True  # undeclared where additionalProperties is false
        return any(self.deref(sub) is False and key_matches(p, name) for p, sub in patterns.items())

    def _exclude_patterns(self, gen: dict, others: list[Schema]) -> dict | None:
        """String `gen` narrowed to start with a character no match of the others' patterns starts with
        (all anchored at the start), or, where one may match anywhere, to be made of such characters only;
        with a pattern of its own, to leave out a character each of theirs needs."""
        if "format" in gen:
            return None
        if "pattern" in gen:
            own, left_out = regex_shape(gen["pattern"]), set()
            for other in map(self.deref, others):
                shape = regex_shape(other["pattern"]) if isinstance(other, dict) and own else None
                if shape is None:
                    return None
                # characters one of which every match has: a literal it needs, or what a match starts with
                options = [{c} for c in sorted(shape.required - own.required)]
                if shape.min_len > 0 and shape.first is not None and not shape.first.negated:
                    options.insert(0, set(shape.first.chars))
                if not options:
                    return None
                left_out |= min(options, key=len)
            narrowed = pattern_without(gen["pattern"], left_out)
            return None if narrowed is None else {**gen, "pattern": narrowed}
        starts, anchored = None, True
        for other in map(self.deref, others):
            shape = regex_shape(other["pattern"]) if isinstance(other, dict) else None
            if shape is None or shape.first is None or shape.min_len == 0:
                return None
            starts, anchored = shape.first if starts is None else starts | shape.first, anchored and shape.anchored
        outside = class_outside(starts) if starts is not None else None
        return None if outside is None else {**gen, "type": "string", "pattern": f"^{outside}.*$" if anchored else f"^{outside}*$"}

    def _exclude_values(self, gen: dict, types: set[str], others: list[Schema]) -> dict | None:
        """String or number `gen` narrowed past every value `others` list: longer than the longest
        string, above the largest number (or below the smallest)."""
        values = []
        for other in map(self.deref, others):
            values_of = listed(other) if isinstance(other, dict) else None
            if values_of is None:
                return None
            values += [v for v in values_of if _types_overlap({json_type(v)}, types)]
        if not values:
            return None
        if types <= {"string"}:
            longest = max(len(v) for v in values)
            if gen.get("maxLength", math.inf) <= longest:
                return None
            return {**gen, "minLength": max(gen.get("minLength", 0), longest + 1)}
        low, high = max(values), min(values)
        if gen.get("maximum", math.inf) > low and gen.get("exclusiveMaximum", math.inf) > low:
            return {**gen, "exclusiveMinimum": max(gen.get("exclusiveMinimum", -math.inf), low)}
        if gen.get("minimum", -math.inf) < high and gen.get("exclusiveMinimum", -math.inf) < high:
            return {**gen, "exclusiveMaximum": min(gen.get("exclusiveMaximum", math.inf), high)}
        return None

    def _rejected_values(self, gen: Schema, other: Schema) -> list:
        """The enum/const values of `gen` that `other` rejects ([] unless `gen` lists values)."""
        gen, other = self.deref(gen), self.deref(other)
        values = listed(gen) if isinstance(gen, dict) else None
        return [v for v in values or [] if self.accepts(gen, v) and not self.accepts(other, v)]

    def excludes(self, gen: Schema, other: Schema, depth: int = 0) -> bool:
        """True when every instance `gen` (normalized) can produce is rejected by `other`."""
        gen, other = self.deref(gen), self.deref(other)
        if other is False or gen is False:
            return True
        if gen is True or other is True or depth > 8:
            return False
        for key in ("anyOf", "oneOf"):  # every branch of `other` rejects, or none of `gen`'s produces
            if key in other and all(self.excludes(gen, b, depth + 1) for b in other[key]):
                return True
            if key in gen and all(self.excludes(b, other, depth + 1) for b in gen[key]):
                return True
        if listed(gen) is not None:
            return not any(self.accepts(gen, v) and self.accepts(other, v) for v in listed(gen))
        if listed(other) is not None and not any(self.produces(gen, v) for v in listed(other)):
            return True
        produced, allowed = produced_types(gen), type_set(other)
        if allowed is None and listed(other) is not None:
            allowed = {json_type(v) for v in listed(other)}
        if allowed is not None and not _types_overlap(produced, allowed):
            return True
        if produced == {"string"} and "pattern" in gen and "pattern" in other:
            return full_matches_never_search(gen["pattern"], other["pattern"])
        if produced == {"array"} and gen.get("minItems", 0) >= 1 and self.excludes(_first_item(gen), _first_item(other), depth + 1):
            return True  # every array `gen` produces has a first item `other` rejects
        if produced <= {"object"} and any(self._forbids_name(other, n) for n in gen.get("required", [])):
            return True
        return produced <= {"object"} and (self._discriminated(gen, other, depth) or _never_has_required(gen, other))

    def _discriminated(self, gen: dict, other: dict, depth: int) -> bool:
        """A property that `gen` or `other` requires and whose values `other` rejects."""
        mine, theirs = gen.get("properties", {}), other.get("properties", {})
        for name in dict.fromkeys([*gen.get("required", []), *other.get("required", [])]):
            if name in mine and name in theirs and self.excludes(mine[name], theirs[name], depth + 1):
                if name in gen.get("required", []) or not gen.get("patternProperties"):
                    return True
        return False

    def produces(self, s: dict, value: Any) -> bool:
        """May node `s` produce `value`? Its own keywords decide, not the raw schema (which may
        say more: a `not` being narrowed away)."""
        return self.validator.evolve(schema=s).is_valid(value)


def _may_produce(s: dict, name: str) -> bool:
    """May object node `s` carry property `name`, whatever is merged in later?"""
    props = s.get("properties", {})
    if name in props:
        return props[name] is not False
    return s.get("additionalProperties") is not False or bool(s.get("patternProperties"))

def _first_item(s: dict) -> Schema:
    """The schema an array's first item must meet (prefixItems, draft-07's list `items`, or `items`)."""
    items = s.get("items", True)
    if isinstance(items, list):
        return items[0] if items else s.get("additionalItems", True)
    return (s.get("prefixItems") or [items])[0]

def _never_has_required(gen: dict, other: dict) -> bool:
    """`other` requires a property `gen` never has (declared false, or undeclared where additionalProperties is false)."""
    props = gen.get("properties", {})
    open_ = any(k in gen for k in ("anyOf", "oneOf", "patternProperties", "unevaluatedProperties"))
    closed = not open_ and gen.get("additionalProperties") is False
    return any(props.get(n) is False or (n not in props and closed) for n in other.get("required", []))

def _types_overlap(produced: set[str], allowed: set[str]) -> bool:
    numeric = {"integer", "number"}
    return bool(produced & allowed) or bool(produced & numeric and allowed & numeric)
