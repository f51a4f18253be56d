"""Sound narrowings: what `SchemaNormalizer` does with keywords no backend enforces exactly.

A narrowed schema accepts a subset of what the original accepts, so every output still validates.
`excludes` proves one subschema rejects everything another produces; `exclude_all` narrows one
until the others exclude it (overlapping `oneOf` branches, `not`, the `else` of an `if`). Proofs
use only facts that survive later merges with sibling keywords (a property declared false, or
additionalProperties false).
"""

from __future__ import annotations

import math
from itertools import islice
from typing import TYPE_CHECKING, Any

from moeserve.grammar.errors import GrammarError
from moeserve.grammar.regex_facts import (
    class_outside,
    finite_language,
    full_matches_never_search,
    key_matches,
    regex_shape,
)
from moeserve.grammar.schema_merge import listed, type_set
from moeserve.grammar.schema_node import json_type, produced_types

if TYPE_CHECKING:
    from moeserve.grammar.schema_support import SchemaNormalizer as _Base
else:
    _Base = object

Schema = Any
NUMERIC_SCAN, NUMERIC_WITNESSES = 20_000, 8  # numeric_witnesses: candidates tried, values kept


class Narrowing(_Base):
    """The narrowing half of SchemaNormalizer (which supplies deref, merge, fixed, parts, accepts)."""

    def numeric_witnesses(self, s: dict) -> list[int]:
        """Last resort for a numeric subschema we cannot express (`not`/`oneOf` over `multipleOf`):
        the first few integers its validator accepts from its lower bound up."""
        low = math.floor(max((b for b in (s.get("minimum"), s.get("exclusiveMinimum")) if isinstance(b, (int, float))), default=0))
        return list(islice((v for v in range(low, low + NUMERIC_SCAN) if self.accepts(s, v)), NUMERIC_WITNESSES))

    def split_conditional(self, s: Schema) -> tuple[Schema, list[dict]]:
        """`s` without if/then/else, and the conditional ([] when there is none, or only an `if`)."""
        if not isinstance(s, dict) or "if" not in s:
            return s, []
        rest = self.without(s, "if", "then", "else")
        cond = {k: s[k] for k in ("if", "then", "else") if k in s}
        return rest, [cond] if len(cond) > 1 else []

    def conditionals(self, acc: Schema, conds: list[dict]) -> Schema:
        """`acc` and every if/then/else in `conds`. Mutually exclusive `if`s (a const discriminator)
        become one anyOf of (if_i, then_i, every other else); otherwise each becomes anyOf [acc and
        if and then, acc and else narrowed until the `if` rejects it]."""
        if not conds or acc is False:
            return acc
        ifs = [self.deref(c["if"]) for c in conds]
        if len(conds) > 1 and all(self.excludes(a, b) for a in ifs for b in ifs if a is not b):
            options = []
            for i, cond in enumerate(conds):
                parts = [ifs[i], cond.get("then", True)] + [c.get("else", True) for c in conds if c is not cond]
                options.append(self._merged(acc, parts))
            return self._any_of([o for o in options if o is not None], acc)
        for cond, test in zip(conds, ifs):
            then = self._merged(acc, [test, cond.get("then", True)])
            otherwise = self._merged(acc, [cond.get("else", True)])
            if otherwise is not None:
                otherwise = self.exclude_all(otherwise, [test])
            acc = self._any_of([o for o in (then, otherwise) if o is not None], acc)
        return acc

    def _merged(self, acc: Schema, parts: list[Schema]) -> Schema | None:
        """acc and all of `parts`; None when unsatisfiable or not enforceable."""
        try:
            for part in parts:
                acc = self.merge(acc, self.deref(part))
                if acc is False:
                    return None
        except GrammarError:
            return None
        return acc

    def _any_of(self, options: list[Schema], origin: Schema) -> Schema:
        if not options:
            raise GrammarError("if/then/else: neither outcome of the condition can be enforced here", feature="if/then/else")
        return options[0] if len(options) == 1 else self.fixed({"anyOf": options}, self.parts(origin))

    def dependencies(self, s: dict) -> Schema:
        """dependentRequired / dependentSchemas made to hold always (narrower): merged into the
        object where the property may appear, or, where that leaves nothing, the property is never produced."""
        acc: Schema = self.without(s, "dependentRequired", "dependentSchemas")
        deps = [(name, {"required": list(then)}) for name, then in s.get("dependentRequired", {}).items()]
        for name, then in [*deps, *s.get("dependentSchemas", {}).items()]:
            if not _may_produce(acc, name):
                continue
            try:
                merged = self.merge(acc, self.deref(then))
            except GrammarError:
                if name in acc.get("required", []):
                    raise
                merged = False
            if merged is not False and len(set(merged.get("required", []))) > merged.get("maxProperties", math.inf):
                merged = False
            if merged is not False:
                acc = merged
            elif name in acc.get("required", []):
                return False
            else:
                acc = self.fixed({**acc, "properties": {**acc.get("properties", {}), name: False}}, self.parts(acc))
        return acc

    # -- oneOf ---------------------------------------------------------------------------

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

    def exclude_all(self, gen: Schema, others: list[Schema]) -> Schema | None:
        """`gen`, or a narrowing of it, that every one of `others` rejects; None if not found."""
        if all(self.excludes(gen, o) for o in others):
            return gen
        gen = self.deref(gen)
        if not isinstance(gen, dict) or any(k in gen for k in ("anyOf", "oneOf", "not", "if")):
            return None
        types = produced_types(gen)
        if listed(gen) is not None:
            kept = [v for v in listed(gen) if self.accepts(gen, v) and not any(self.accepts(o, v) for o in others)]
            narrowed = {"enum": kept} if kept else None
        elif types == {"object"}:
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
        return any(self.deref(sub) is False and key_matches(p, name) for p, sub in (other.get("patternProperties") or {}).items())

    def _exclude_patterns(self, gen: dict, others: list[Schema]) -> dict | None:
        """String `gen` narrowed to start with a character no match of the others' (anchored) patterns starts with."""
        if "pattern" in gen or "format" in gen:
            return None
        starts = None
        for other in map(self.deref, others):
            shape = regex_shape(other["pattern"]) if isinstance(other, dict) else None
            if shape is None or shape.first is None or not shape.anchored or shape.min_len == 0:
                return None
            starts = shape.first if starts is None else starts | shape.first
        outside = class_outside(starts) if starts is not None else None
        return None if outside is None else {**gen, "type": "string", "pattern": f"^{outside}.*$"}

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

    def contains_first(self, kw: dict, prefix: list, items: Any) -> tuple[list, Any]:
        """Array keywords `kw` with `contains` (at least minContains items match it) made to hold by the
        first items (narrower): the first minContains positions take their schema and `contains` too, and
        the array is at least that long; maxContains only where maxItems already bounds the array by it.
        Returns (prefixItems, items), items True where absent (strict mode would end the array)."""
        items = True if items is None else items
        need, most = kw.get("minContains", 1), kw.get("maxItems", math.inf)
        if need > min(most, kw.get("maxContains", math.inf)):
            raise GrammarError("contains: minContains is more than maxItems or maxContains allow", feature="contains")
        if kw.get("maxContains", math.inf) < most:
            raise GrammarError("contains: maxContains below maxItems is not supported", feature="contains")
        own = [*prefix, *[items] * max(need - len(prefix), 0)]
        kw["minItems"] = max(kw.get("minItems", 0), need)
        return [{"allOf": [x, kw["contains"]]} if i < need else x for i, x in enumerate(own)] if need else prefix, items

    def negation(self, s: dict) -> Schema | None:
        """`s` without its `not`, narrowed until the negated schema rejects it; None if not found."""
        neg = self.deref(s["not"])
        rest = self.without(s, "not")
        if neg is False:
            return rest
        if neg is True or neg == {}:  # not {} matches nothing
            return False
        others, flat = [neg], []
        while others:  # not (A or (B or C)): excluded by each of A, B, C
            o = self.deref(others.pop())
            if isinstance(o, dict) and set(o) == {"anyOf"}:
                others += o["anyOf"]
            else:
                flat.append(o)
        return self.exclude_all(rest, flat)

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


def _never_has_required(gen: dict, other: dict) -> bool:
    """`other` requires a property `gen` never has (declared false, or undeclared where additionalProperties is false)."""
    props = gen.get("properties", {})
    open_ = any(k in gen for k in ("anyOf", "oneOf", "patternProperties", "unevaluatedProperties"))
    closed = not open_ and gen.get("additionalProperties") is False
    return any(props.get(n) is False or (n not in props and closed) for n in other.get("required", []))


def _types_overlap(produced: set[str], allowed: set[str]) -> bool:
    numeric = {"integer", "number"}
    return bool(produced & allowed) or bool(produced & numeric and allowed & numeric)
