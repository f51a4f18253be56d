"""Which JSON schemas we can enforce exactly, and the rewrite that makes xgrammar enforce them.

Every output produced under a schema must validate against it, but xgrammar 0.2.9 silently
ignores some keywords (`not`, `if`, `uniqueItems`, several `allOf` branches, ...). So
`prepare_json_schema` rewrites what it can exactly, narrows what it cannot to a schema whose every
instance still validates, and refuses the rest with a GrammarError naming the keyword. Every node
is rebuilt from the keywords it handles, so an unknown keyword cannot slip through.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote

import jsonschema

from moeserve.grammar.errors import GrammarError
from moeserve.grammar.schema_drafts import ANNOTATIONS, Draft, schema_draft
from moeserve.grammar.schema_merge import json_key, listed, merge_schemas, type_set
from moeserve.grammar.schema_narrowing import Narrowing
from moeserve.grammar.schema_node import normalize_node
from moeserve.grammar.unicode_classes import with_python_patterns

MAX_DEPTH = 200  # nesting/ref-chain depth; real schemas stay far below, recursive tricks do not
# Refusals of the xgrammar path that llguidance enforces exactly and always lets finish (random
# decodes of every JSONSchemaBench schema with these features end, and validate). Not here:
# patternProperties (llguidance lets a key grow that no pattern can ever match, so a decode may
# never end), and what llguidance refuses itself (not, oneOf, uniqueItems, if/then/else, ...).
LLGUIDANCE_FEATURES = frozenset({"multipleOf", "length+pattern", "format+pattern", "format+length", "$ref:anchor",
                                 "allOf:pattern", "minProperties"})
MAX_MERGES = 20_000  # merges can multiply (anyOf siblings x branches); bound the work per schema

Schema = Any
_DROPPED = ANNOTATIONS | {"$defs", "definitions"}


def prepare_json_schema(schema: Schema, one_of: str, keep: frozenset[str] = frozenset()) -> Schema:
    """Validate `schema` and return an equivalent-or-narrower schema xgrammar enforces exactly
    (one_of "as_any_of": an overlapping oneOf as anyOf, GrammarSection.one_of). Raises GrammarError
    naming the problem: an invalid schema, or the unsupported feature. `keep`: features (of
    LLGUIDANCE_FEATURES) to pass on as written, for llguidance (`for_llguidance`)."""
    schema = with_python_patterns(schema)
    draft = schema_draft(schema)
    try:
        draft.validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"invalid JSON schema ({draft.name}) at {where}: {e.message}", feature="invalid-schema") from None
    try:
        return SchemaNormalizer(schema, draft, one_of_as_any_of=one_of == "as_any_of", keep=keep).run()
    except RecursionError:
        raise GrammarError("schema nests too deeply to compile", feature="depth") from None


def for_llguidance(schema: Schema, one_of: str) -> Schema:
    """`schema` narrowed as for xgrammar, but with what llguidance enforces exactly kept as written,
    and every object closed (additionalProperties false where absent), which the narrowings assume
    (xgrammar's strict mode). GrammarError for what neither backend takes."""
    return _closed(prepare_json_schema(schema, one_of, keep=LLGUIDANCE_FEATURES))


def _closed(s: Schema) -> Schema:
    if isinstance(s, list):
        return [_closed(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: v if k in ("enum", "const", "required") else
           {name: _closed(x) for name, x in v.items()} if k in ("properties", "patternProperties", "$defs") else
           _closed(v) for k, v in s.items()}
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class SchemaNormalizer(Narrowing):
    """One pass over one schema document. Subschemas are handled in their *fixed* form (draft
    quirks rewritten, annotations dropped); `origins` maps each fixed dict to the raw subschemas
    it means together, so `enum`/`oneOf` decisions can ask the draft's own validator."""

    def __init__(self, root: Schema, draft: Draft, one_of_as_any_of: bool, keep: frozenset[str]) -> None:
        self.root = root
        self.one_of_as_any_of, self.keep = one_of_as_any_of, keep
        self.draft = draft
        self.validator = draft.validator(root, format_checker=draft.validator.FORMAT_CHECKER)
        self.defs: dict[str, Schema] = {}
        self.def_names: dict[str, str] = {}  # $ref string -> our $defs name
        self.origins: dict[int, tuple[list[Schema], dict]] = {}  # id(fixed) -> (raw parts, fixed) kept alive
        self.depth = 0
        self.merges = 0
        self.merging: set[tuple[int, int]] = set()  # merges in progress, to catch recursive ones
        self.fixed_of: dict[int, dict] = {}  # id(raw) -> its fixed form, so a raw node is fixed once
        self.id_scopes = 0  # > 0 while inside a subschema with its own $id

    def run(self) -> Schema:
        body = self.norm(self.root, is_root=True)
        if body is False:
            raise GrammarError("the schema accepts no value at all, or none that this server can enforce", feature="unsatisfiable")
        if self.defs and isinstance(body, dict):
            body = {**body, "$defs": self.defs}
        return body

    # -- the walk -------------------------------------------------------------------------

    def norm(self, raw: Schema, *, is_root: bool = False) -> Schema:
        """Normalized form of one subschema (raw or fixed)."""
        if self.depth >= MAX_DEPTH:
            raise GrammarError(f"schema nests deeper than {MAX_DEPTH} levels", feature="depth")
        scoped = not is_root and self._has_base_id(raw)
        self.depth += 1
        self.id_scopes += scoped
        try:
            return self._norm(raw)
        finally:
            self.depth -= 1
            self.id_scopes -= scoped

    def _norm(self, raw: Schema) -> Schema:
        s = self.fixup(raw) if isinstance(raw, dict) else None
        if s is None or not (type_set(s) or {"object"}) <= {"integer", "number"}:
            return self._norm_exact(raw)
        try:
            with self.attempt():
                return self._norm_exact(raw)
        except GrammarError as e:
            values = [] if e.feature in LLGUIDANCE_FEATURES else self.numeric_witnesses(s)  # (the compiler's 2nd backend)
            if not values:
                raise
            return {"enum": values}

    def _norm_exact(self, raw: Schema) -> Schema:
        s = self.prep(raw)
        if isinstance(s, bool):
            return s
        if set(s) == {"$ref"}:
            return {"$ref": self.ref_target(s["$ref"])}
        if "enum" in s or "const" in s:
            return self.finite(s)
        if "anyOf" in s or "oneOf" in s:
            return self.alternatives(s)
        return normalize_node(self, s)

    def prep(self, raw: Schema) -> Schema:
        """Fix draft quirks, then fold `allOf` and 2019+ `$ref` siblings into one plain node."""
        s = self.fixup(raw)
        while isinstance(s, dict):
            if "$ref" in s and len(s) > 1:
                if self.draft.year <= 7:  # a $ref replaces its whole object; later drafts AND its siblings in
                    s = self.fixed({"$ref": s["$ref"]}, self.parts(s))
                    continue
                s = self.merge(self.deref(self.fixed({"$ref": s["$ref"]}, [])), self.without(s, "$ref"))
            elif "allOf" in s:
                rest, conds = self.split_conditional(self.without(s, "allOf"))
                acc = self.deref(rest)
                for branch in s["allOf"]:
                    branch, cond = self.split_conditional(self.fixup(branch))
                    conds += cond
                    acc = self.merge(acc, self.deref(branch))
                s = self.conditionals(acc, conds)
            elif "if" in s:
                rest, conds = self.split_conditional(s)
                s = self.conditionals(self.deref(rest), conds)
            elif "dependentRequired" in s or "dependentSchemas" in s:
                s = self.dependencies(s)
            elif "not" in s and (narrowed := self.negation(s)) is not None:
                s = narrowed
            else:
                return s
        return s

    def deref(self, raw: Schema) -> Schema:
        """`prep`, then replace a bare `{"$ref": ...}` by its (prepped) target."""
        seen = set()
        s = self.prep(raw)
        while isinstance(s, dict) and set(s) == {"$ref"}:
            if s["$ref"] in seen:
                raise GrammarError(f"$ref cycle through {s['$ref']!r} with nothing in between", feature="$ref")
            seen.add(s["$ref"])
            s = self.prep(self.resolve(s["$ref"]))
        return s

    def merge(self, a: Schema, b: Schema) -> Schema:
        self.merges += 1
        if self.merges > MAX_MERGES:
            raise GrammarError(f"schema needs more than {MAX_MERGES} allOf/sibling merges", feature="depth")
        pair = (id(a), id(b))
        if pair in self.merging:
            raise GrammarError("allOf (or $ref siblings) over a recursive schema is not supported", feature="allOf:recursive")
        self.merging.add(pair)
        try:
            out = merge_schemas(a, b, self.deref, self.merge)
        finally:
            self.merging.discard(pair)
        if isinstance(out, dict) and out is not a and out is not b:
            self.fixed(out, self.parts(a) + self.parts(b))
        return out

    def finite(self, s: dict) -> Schema:
        """enum/const: keep exactly the listed values the whole (raw) schema accepts."""
        values = listed(s)
        if "const" in s and "enum" in s:
            values = [v for v in s["enum"] if json_key(v) == json_key(s["const"])]
        kept, seen = [], set()
        for v in values:
            if json_key(v) not in seen and self.accepts(s, v):
                seen.add(json_key(v))
                kept.append(v)
        return {"enum": kept} if kept else False  # none: nothing satisfies this subschema

    def alternatives(self, s: dict) -> Schema:
        """anyOf / oneOf: distribute the sibling keywords into each branch; oneOf must be provably disjoint."""
        if "anyOf" in s and "oneOf" in s:
            raise GrammarError("anyOf and oneOf in the same schema object are not supported", feature="anyOf+oneOf")
        key = "anyOf" if "anyOf" in s else "oneOf"
        siblings = self.without(s, key)
        branches = [self.merge(siblings, self.deref(b)) if siblings else self.prep(b) for b in s[key]]
        branches = [b for b in branches if b is not False]  # a branch nothing satisfies never matches
        if key == "oneOf":
            branches = self.exclusive(branches)
        out = [n for n in (self.norm(b) for b in branches) if n is not False]
        if not out:
            raise GrammarError(f"{key}: no branch can be satisfied", feature=key)
        return out[0] if len(out) == 1 else {"anyOf": out}

    # -- plumbing ------------------------------------------------------------------------

    def accepts(self, s: Schema, value: Any) -> bool:
        """Does the raw schema behind fixed node `s` accept `value`? (the draft's own validator)"""
        return all(self.validator.evolve(schema=raw).is_valid(value) for raw in self.parts(s))

    def fixup(self, raw: Schema) -> Schema:
        if isinstance(raw, bool) or id(raw) in self.origins:
            return raw
        if id(raw) in self.fixed_of:
            return self.fixed_of[id(raw)]
        if not isinstance(raw, dict):
            raise GrammarError(f"a subschema must be an object or a boolean, got {type(raw).__name__}", feature="invalid-schema")
        # Unknown keywords and annotations constrain nothing; $defs/definitions are reached only via resolve().
        s = {k: v for k, v in raw.items() if k in self.draft.vocabulary and k not in _DROPPED}
        if self.draft.year == 4:  # draft-04: exclusiveMinimum is a flag on minimum
            for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
                if flag in s and s.pop(flag) is True and bound in s:
                    s[flag] = s.pop(bound)
        if self.draft.year <= 2019 and isinstance(s.get("items"), list):  # tuple form, additionalItems the rest
            s["prefixItems"] = s.pop("items")
            if "additionalItems" in s:
                s["items"] = s.pop("additionalItems")
        s.pop("additionalItems", None)  # without tuple items it constrains nothing
        for key in ("anyOf", "oneOf"):  # one alternative: that alternative
            if isinstance(s.get(key), list) and len(s[key]) == 1:
                s["allOf"] = [*s.get("allOf", []), *s.pop(key)]
        for name, then in s.pop("dependencies", {}).items():  # draft-07 and older: both forms in one keyword
            key = "dependentRequired" if isinstance(then, list) else "dependentSchemas"
            s[key] = {**s.get(key, {}), name: then}
        self.fixed_of[id(raw)] = s
        return self.fixed(s, [raw])

    def fixed(self, s: dict, parts: list[Schema]) -> dict:
        self.origins[id(s)] = (parts, s)
        return s

    def without(self, s: dict, *keys: str) -> dict:
        return self.fixed({k: v for k, v in s.items() if k not in keys}, self.parts(s))

    def parts(self, s: Schema) -> list[Schema]:
        if isinstance(s, bool):
            return [] if s else [False]
        return self.origins[id(s)][0]

    def resolve(self, ref: Any) -> Schema:
        """The raw subschema a local `$ref` points to."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GrammarError(f"only local $ref ('#/...') is supported, got {ref!r}", feature="$ref:remote")
        pointer = unquote(ref[1:])
        if pointer and not pointer.startswith("/"):
            raise GrammarError(f"$ref to an anchor ({ref!r}) is not supported; use a JSON pointer", feature="$ref:anchor")
        if self.id_scopes:
            raise GrammarError("$ref inside a subschema with its own $id is not supported", feature="$id")
        node = self.root
        for token in pointer.split("/")[1:] if pointer else []:
            if node is not self.root and self._has_base_id(node):
                raise GrammarError(f"$ref {ref!r} points into a subschema with its own $id; not supported", feature="$id")
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise GrammarError(f"$ref {ref!r} does not resolve", feature="$ref")
        if node is not self.root and self._has_base_id(node):
            raise GrammarError(f"$ref {ref!r} points to a subschema with its own $id; not supported", feature="$id")
        return node

    def _has_base_id(self, node: Schema) -> bool:
        """Does this raw subschema set a new base URI (which changes how $refs inside resolve)?"""
        if not isinstance(node, dict) or id(node) in self.origins:
            return False
        value = node.get("id") if self.draft.year == 4 else node.get("$id")  # draft-04 spells it `id`
        return isinstance(value, str) and not value.startswith("#")

    @contextmanager
    def attempt(self) -> Iterator[None]:
        """Normalization that a GrammarError abandons takes its $defs along (a half-made one would
        stay a `true` placeholder)."""
        defs, names = dict(self.defs), dict(self.def_names)
        try:
            yield
        except GrammarError:
            self.defs, self.def_names = defs, names
            raise

    def ref_target(self, ref: str) -> str:
        """Our `$defs` pointer for `ref`, normalizing its target once (recursion-safe)."""
        if ref not in self.def_names:
            name = f"d{len(self.def_names)}"
            self.def_names[ref] = name
            self.defs[name] = True  # placeholder while the target (which may refer back) is normalized
            self.defs[name] = self.norm(self.resolve(ref))
        return f"#/$defs/{self.def_names[ref]}"

