"""Sound narrowings: what `SchemaNormalizer` does with keywords no backend enforces exactly.

A narrowed schema accepts a subset of what the original accepts, so every output still validates:
`if`/`then`/`else`, dependencies, `contains` and `not` rewritten into what both backends enforce
(`not` and the `else` of an `if` by `Exclusion.exclude_all`, schema_exclusion.py).
"""

from __future__ import annotations

import math
from itertools import islice
from typing import Any

from moeserve.grammar.errors import GrammarError
from moeserve.grammar.schema_exclusion import Exclusion, _may_produce

Schema = Any
NUMERIC_SCAN, NUMERIC_WITNESSES = 20_000, 8  # numeric_witnesses: candidates tried, values kept


class Narrowing(Exclusion):
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
        return self.exclude_all(rest, [neg])  # (not (A or B): excluded by each of A and B)
