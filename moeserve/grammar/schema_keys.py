"""Object keys as xgrammar takes them: `patternProperties` (key regexes, each with the schema its
keys need) and `propertyNames` (string constraints on every key), narrowed where the two meet or a
`minProperties` needs fresh names. Used by `schema_node._objects`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from moeserve.grammar.errors import GrammarError
from moeserve.grammar.regex_compat import xgrammar_regex
from moeserve.grammar.regex_facts import finite_language, full_matches_never_search, key_matches
from moeserve.grammar.regex_rewrite import fold_lengths_into_pattern
from moeserve.grammar.schema_drafts import ANNOTATIONS
from moeserve.grammar.schema_merge import listed, type_set

if TYPE_CHECKING:
    from moeserve.grammar.schema_support import SchemaNormalizer

_NAME_KEYWORDS = {"type", "minLength", "maxLength", "pattern", "format", "enum"}
_INNER_ANCHOR = re.compile(r"(?<!\\)[$^](?![^\[]*\])")  # an unescaped ^ or $ outside a character class


def fresh_properties(nz: SchemaNormalizer, count: int, taken: dict, names: Any, extra: Any) -> dict[str, Any]:
    """`count` properties named apart from `taken` as propertyNames allows (its listed names, then key1, key2,
    ...), each of the additionalProperties schema: minProperties met by distinct declared keys (narrower)."""
    rule = nz.deref(names)
    pool = [v for v in listed(rule) or [] if isinstance(v, str)] if isinstance(rule, dict) else []
    allowed = nz.validator.evolve(schema=rule).is_valid
    fresh = [n for n in dict.fromkeys(pool + [f"key{i}" for i in range(1, count + 64)]) if n not in taken and allowed(n)]
    fresh = fresh[:count]
    if len(fresh) < count:
        raise GrammarError.refused("minProperties", f"minProperties {count + len(taken)} needs names propertyNames does not allow")
    return dict.fromkeys(fresh, nz.norm(extra) if isinstance(extra, dict) else True)


def lengths_into_patterns(nz: SchemaNormalizer, patterns: dict, names: Any, declared: dict) -> dict[str, Any]:
    """patternProperties whose key patterns also hold propertyNames' length bounds (the only rule taken here)."""
    rule = nz.deref(names)
    rule = {k: v for k, v in rule.items() if k not in ANNOTATIONS and (k, v) != ("type", "string")} if isinstance(rule, dict) else None
    if declared or rule is None or not set(rule) <= {"minLength", "maxLength"}:
        raise GrammarError.refused("patternProperties", "patternProperties with propertyNames beyond a length bound is not supported")
    folded = {}
    for pattern, sub in patterns.items():
        kw = {"pattern": pattern, **rule}
        fold_lengths_into_pattern(kw)
        if set(kw) != {"pattern"}:
            raise GrammarError.refused("patternProperties", f"cannot bound the length of keys matching {pattern!r}")
        folded[kw["pattern"]] = sub
    return folded


def pattern_keys(nz: SchemaNormalizer, patterns: dict, declared: dict, required: list) -> dict[str, Any]:
    """patternProperties as xgrammar gets them (key regex -> normalized schema): a pattern with a
    few full matches becomes those names, declared; disjoint patterns keep their own schemas; the
    others share one key regex."""
    for pattern in patterns:
        declared.update({name: True for name in finite_language(pattern) or () if name not in declared})
    matching = _fold_patterns(nz, patterns, declared, required)
    rest = {p: sub for p, sub in patterns.items() if finite_language(p) is None}
    disjoint = all(full_matches_never_search(p, q) for p in rest for q in rest if p != q)
    groups = [{p: sub} for p, sub in rest.items()] if disjoint else [rest] if rest else []
    values = [(_key_regex(g), _key_schema(nz, g, declared, matching)) for g in groups]
    return {regex: value for regex, value in values if value is not False}


def _fold_patterns(nz: SchemaNormalizer, patterns: dict, declared: dict, required: list) -> dict[str, list[str]]:
    """Merge into each declared or required name the patterns it matches; returns name -> those patterns."""
    matching: dict[str, list[str]] = {}
    for name in dict.fromkeys([*declared, *required]):
        hits = [pattern for pattern in patterns if key_matches(pattern, name)]
        if hits:
            matching[name] = hits
            merged = nz.deref(declared.get(name, True))
            for pattern in hits:
                merged = nz.merge(merged, nz.deref(patterns[pattern]))
            declared[name] = merged
    return matching


def _key_schema(nz: SchemaNormalizer, group: dict, declared: dict, matching: dict[str, list[str]]) -> Any:
    """The normalized schema of the keys one regex produces for `group` (False: none, narrower).
    Such a key may repeat or be a declared name, so the schema is every pattern's and every
    matching declared name's at once."""
    subs = [*group.values(), *(declared[name] for name, hits in matching.items() if set(hits) & set(group))]
    value: Any = subs[0]  # (one alone keeps its $ref: a recursive schema stays a reference)
    why = "no value satisfies them all"
    try:
        with nz.attempt():
            for sub in subs[1:]:
                value = nz.merge(nz.deref(value), nz.deref(sub))
            value = nz.norm(value)
    except GrammarError as e:
        value, why = False, e.message
    if value is False and len(group) > 1 and not declared:  # nothing left to produce but {}
        raise GrammarError.refused("patternProperties", f"a key may match several of the patterns, and {why}")
    return value


def _key_regex(patterns: dict) -> str:
    """One regex whose full matches each search-match some pattern (an alternation without outer anchors)."""
    if len(patterns) == 1:
        return xgrammar_regex(next(iter(patterns)), dot_excludes_newline=False)
    parts = []
    for pattern in patterns:
        body = pattern[1:] if pattern.startswith("^") else pattern
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
        if _INNER_ANCHOR.search(body):
            raise GrammarError.refused("patternProperties", f"pattern {pattern!r} has anchors inside it; cannot combine it with other patterns")
        parts.append(f"(?:{body})")
    return xgrammar_regex("^(?:" + "|".join(parts) + ")$", dot_excludes_newline=False)


def property_names(nz: SchemaNormalizer, names: Any, props: dict, out: dict) -> None:
    n = nz.norm(names)
    if n is True or n == {}:
        return
    branch = None
    if isinstance(n, dict) and set(n) == {"anyOf"}:  # narrower: the names its first expressible branch allows
        n = branch = next((b for b in n["anyOf"] if isinstance(b, dict) and set(b) <= _NAME_KEYWORDS), n)
    if not isinstance(n, dict) or not set(n) <= _NAME_KEYWORDS or "string" not in (type_set(n) or {"string"}):
        raise GrammarError.refused("propertyNames", "only string constraints (pattern, length, format, enum) are supported")
    fixed = nz.deref(names)
    in_branch = nz.validator.evolve(schema=branch).is_valid if branch else lambda _name: True
    bad = [name for name in props if not nz.accepts(fixed, name) or not in_branch(name)]
    if bad:
        raise GrammarError.refused("propertyNames", f"declared properties {bad} do not satisfy propertyNames")
    out["propertyNames"] = n
