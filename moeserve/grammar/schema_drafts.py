"""JSON-Schema drafts: which draft a schema declares, its validator, and its keyword vocabulary.

A keyword counts only in the drafts that define it (`const` in a draft-04 schema is ignored by
every validator, so by the grammar too); keywords no draft defines (`x-foo`, `nullable`) likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.protocols import Validator

from moeserve.grammar.errors import GrammarError

# Keywords that never constrain an instance: dropped before compiling.
ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$comment", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary",
    "title", "description", "default", "examples", "example", "deprecated", "readOnly", "writeOnly",
    "contentEncoding", "contentMediaType", "contentSchema",
})  # fmt: skip

_DRAFT4 = frozenset({
    "type", "enum", "properties", "required", "additionalProperties", "patternProperties",
    "minProperties", "maxProperties", "items", "additionalItems", "minItems", "maxItems", "uniqueItems",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "allOf", "anyOf", "oneOf", "not", "dependencies", "$ref", "definitions",
})  # fmt: skip
_DRAFT6 = _DRAFT4 | {"const", "contains", "propertyNames"}
_DRAFT7 = _DRAFT6 | {"if", "then", "else"}
_DRAFT2019 = (_DRAFT7 - {"dependencies"}) | {
    "$defs", "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems",
    "minContains", "maxContains", "$recursiveRef",
}  # fmt: skip
_DRAFT2020 = (_DRAFT2019 - {"additionalItems", "$recursiveRef"}) | {"prefixItems", "$dynamicRef"}


@dataclass(frozen=True)
class Draft:
    """One JSON-Schema draft as this layer needs it."""

    name: str
    year: int  # 4, 6, 7, 2019, 2020: ordered, so `year <= 7` reads "draft-07 or older"
    validator: type[Validator]
    vocabulary: frozenset[str]


DRAFTS = {
    4: Draft("draft-04", 4, jsonschema.Draft4Validator, _DRAFT4),
    6: Draft("draft-06", 6, jsonschema.Draft6Validator, _DRAFT6),
    7: Draft("draft-07", 7, jsonschema.Draft7Validator, _DRAFT7),
    2019: Draft("2019-09", 2019, jsonschema.Draft201909Validator, _DRAFT2019),
    2020: Draft("2020-12", 2020, jsonschema.Draft202012Validator, _DRAFT2020),
}

# json-schema.org/draft-07/schema, json-schema.org/draft/2020-12/schema, ...
_BY_URI = {f"json-schema.org/{'' if d.year < 2019 else 'draft/'}{d.name}/schema": d for d in DRAFTS.values()}


def schema_draft(schema: Any) -> Draft:
    """The draft `schema` declares with `$schema`; 2020-12 when it declares none (as jsonschema does)."""
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    if uri is None:
        return DRAFTS[2020]
    if not isinstance(uri, str):
        raise GrammarError("$schema must be a string", feature="$schema")
    bare = uri.split("://", 1)[-1].rstrip("#")
    if bare not in _BY_URI:
        raise GrammarError(
            f"unsupported $schema {uri!r}: use draft-04, -06, -07, 2019-09 or 2020-12 (or omit it for 2020-12)",
            feature="$schema",
        )
    return _BY_URI[bare]
