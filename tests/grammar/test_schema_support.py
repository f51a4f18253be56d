"""What we enforce, rewrite and refuse in JSON Schema, keyword by keyword.

Every "ok" case compiles and its grammar accepts the valid instances and refuses the invalid
ones (as compact JSON); each exists because xgrammar 0.2.9 alone got it wrong or because we
rewrite it (see test_xgrammar_quirks.py for the raw behaviour). Every "llguidance" case is one
the xgrammar path refuses and the second backend enforces, checked the same way. Every
"refused" case raises GrammarError with the named feature instead of compiling a grammar that
would let invalid output through.
"""

from __future__ import annotations

import json

import pytest

from moeserve.grammar import GrammarError, GrammarMatcher, GrammarSpec

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
OBJ_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}


def accepts(compiled, instance, tokenizer) -> bool:
    matcher = GrammarMatcher(compiled)
    text = instance if isinstance(instance, Raw) else json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    ids = tokenizer.encode(str(text), add_special_tokens=False)
    return matcher.accept_tokens(ids) == len(ids) and matcher.is_completed()


class Raw(str):
    """Output text given literally instead of as a JSON value."""


OK = [
    # (name, schema, valid instances, invalid instances)
    ("pattern", {"type": "string", "pattern": "^a+$"}, ["aaa"], ["ab"]),
    ("format email", {"type": "string", "format": "email"}, ["a@b.co"], ["nope"]),
    ("format date (real calendar)", {"type": "string", "format": "date"}, ["2024-02-29", "2023-11-30"], ["2023-11-31", "2023-02-29", "0000-01-01"]),
    ("format date-time", {"type": "string", "format": "date-time"}, ["2020-01-01T00:00:00Z", "2020-01-01T23:59:59.5+05:30"], ["2020-01-01T24:00:00Z", "2020-01-01T00:00:0012Z"]),
    ("format unknown is an annotation", {"type": "string", "format": "int32"}, ["x"], [1]),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "éé"], ["a", "abcd"]),
    ("numbers", {"type": "number", "minimum": 1.5, "exclusiveMaximum": 3}, [1.5, 2.99], [1.4, 3, Raw("3.0")]),
    ("integer non-integral bounds", {"type": "integer", "minimum": 1.5, "maximum": 4.5}, [2, 4], [1, 5]),
    ("integer exclusive", {"type": "integer", "exclusiveMinimum": 1.5, "exclusiveMaximum": 4}, [2, 3], [1, 4]),
    ("draft-04 exclusive flags", {"$schema": D4, "type": "integer", "minimum": 5, "exclusiveMinimum": True}, [6], [5]),
    ("multipleOf on integers", {"type": "integer", "multipleOf": 3}, [6], [7]),
    ("type inferred from keywords", {"minimum": 3}, [3], [2, "x"]),
    ("type list", {"type": ["integer", "null"], "minimum": 0}, [0, None], [-1, "x"]),
    ("enum filtered by siblings", {"type": "string", "enum": ["a", 1, "bb"], "maxLength": 1}, ["a"], [1, "bb"]),
    ("const", {"const": {"a": 1}}, [{"a": 1}], [{"a": 2}]),
    ("required not in properties", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, [{"b": 1}], [{"a": 1}]),
    ("required but forbidden: not an object", {"anyOf": [{"type": "object", "required": ["b"], "additionalProperties": False},
                                                         {"type": "integer"}]}, [1], [{"b": 1}, {}]),
    ("additionalProperties false", {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}, [{"a": 1}], [{"a": 1, "b": 2}]),
    ("additionalProperties schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}, [{"a": 1, "b": "x"}], [{"a": 1, "b": 2}, {"a": "x"}]),
    ("min/maxProperties", {"type": "object", "properties": OBJ_AB, "minProperties": 1, "maxProperties": 1}, [{"a": 1}], [{}, {"a": 1, "b": 1}]),
    ("minProperties 1: any one entry, undeclared keys too", {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
     [{"a": 1}, {"a": 1, "b": 2}], [{}, {"a": "s"}]),
    ("minProperties: declared keys only (no duplicates)", {"type": "object", "properties": OBJ_AB, "additionalProperties": True, "minProperties": 2},
     [{"a": 1, "b": 2}], [{"a": 1, "c": 2}, Raw('{"a":1,"a":2}')]),
    ("array without items", {"type": "array", "minItems": 2}, [[1, "x"]], [[1]]),
    ("tuple items (draft-07)", {"$schema": D7, "type": "array", "items": [{"type": "integer"}], "additionalItems": False}, [[1]], [[1, 2], ["a"]]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, [[1, "a"]], [["a", 1]]),
    # contains holds by the first items (narrower): [5, ...] passes, [1, 5] is valid but refused
    ("contains, by the first item", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}},
     [[5], [5, 1, 2]], [[], [1], ["x"], [5, "x"], [1, 5]]),
    ("minContains 2 after a prefix item", {"type": "array", "prefixItems": [{"type": "integer", "minimum": 3}],
                                          "contains": {"type": "integer", "maximum": 5}, "minContains": 2},
     [[4, 5], [3, 0, "x"]], [[6, 5], [4], [4, "x"]]),
    ("format regex: literal text", {"type": "string", "format": "regex"}, ["ab c", "", "a-b_1"], ["a(", "a*", 1]),
    # with propertyNames (which llguidance lacks), minProperties over undeclared keys: fresh declared names
    ("patternProperties and propertyNames' length: keys meeting both", {"type": "object", "patternProperties": {"^[a-c]+$": {"type": "integer"}},
                                                                          "propertyNames": {"type": "string", "minLength": 2}},
     [{"ab": 1}, {}, {"abc": 1, "ca": 2}], [{"a": 1}, {"ab": "x"}, {"dd": 1}]),
    ("propertyNames anyOf: its first branch", {"type": "object", "additionalProperties": {"type": "integer"},
                                               "propertyNames": {"anyOf": [{"pattern": "^[a-z]+$"}, {"pattern": "[*?]"}]}},
     [{"ab": 1}], [{"AB": 1}, {"ab": "x"}]),
    ("minProperties by propertyNames' names", {"type": "object", "propertyNames": {"enum": ["a", "b", "c"]},
                                                "additionalProperties": {"type": "string"}, "minProperties": 2},
     [{"a": "x", "b": "y"}], [{"a": "x"}, {"a": 1, "b": "y"}, {"a": "x", "d": "y"}]),
    ("uniqueItems trivially true", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1}, [[1]], [[1, 1]]),
    # narrowed (sound: what the grammar accepts validates; some valid instances are no longer produced)
    ("uniqueItems: at most one item", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [[], [1]], [[1, 1]]),
    ("not type: the other types", {"not": {"type": ["string", "number"]}}, [None, True, [1], {}], ["x", 1, 1.5]),
    ("not enum: longer than every excluded string", {"type": "string", "not": {"enum": ["a", "bb"]}}, ["ccc"], ["a", "bb"]),
    ("not enum on integers: above the largest", {"type": "integer", "minimum": 0, "not": {"enum": [1, 5]}}, [6, 100], [1, 5, -1]),
    ("two nots (allOf)", {"type": "integer", "allOf": [{"not": {"const": 3}}, {"not": {"const": 7}}]}, [8], [3, 7]),
    ("oneOf: listed strings inside a pattern", {"oneOf": [{"enum": ["ab", "cd"]}, {"type": "string", "pattern": "^[a-z]+$"}]},
     ["abc"], ["ab", "cd", "AB"]),
    ("not inside a branch, siblings merged later", {"type": "object", "properties": {"a": {}, "b": {}},
                                                    "allOf": [{"anyOf": [{"not": {"required": ["a", "b"]}}]}]},
     [{"a": 1}], [{"a": 1, "b": 2}]),
    ("not {} matches nothing", {"type": "object", "properties": {"x": {"not": {}}, "y": {}}}, [{"y": 1}], [{"x": 1}]),
    ("not patterns that match anywhere: none of their first characters", {"type": "string", "allOf": [
        {"not": {"pattern": "\\.\\."}}, {"not": {"pattern": "[ ~:]"}}]}, ["abc", "", "a-b"], ["a..b", "a b", "x:y", 1]),
    ("not pattern: first character outside the pattern's", {"type": "string", "not": {"pattern": "^[ .-]+$"}},
     ["a", "a. -"], [" ", ".-", "- "]),
    ("oneOf of patterns with different first characters", {"oneOf": [{"type": "string", "pattern": "^int[0-9]*$"},
                                                                     {"type": "string", "pattern": "^uint[0-9]*$"}]},
     ["int8", "uint16"], ["x", "int8x"]),
    ("disjoint patternProperties keep their own schemas", {"type": "object", "additionalProperties": False,
                                                           "patternProperties": {"^a$": {"type": "string"}, "^b+$": {"type": "integer"}}},
     [{"a": "x", "bb": 1}], [{"a": 1}, {"bb": "x"}, {"c": 1}]),
    ("numbers we cannot express: the first values the validator accepts", {"type": "integer", "minimum": 10,
                                                                           "oneOf": [{"multipleOf": 2}, {"multipleOf": 3}]},
     [10, 14, 15], [12, 18, 11, 9]),
    ("patternProperties naming a few keys: those keys, declared", {"type": "object", "additionalProperties": False,
                                                                   "patternProperties": {"^[a-c]$": {"type": "integer"}}, "minProperties": 2},
     [{"a": 1, "c": 2}, {"a": 1, "b": 2, "c": 3}], [{"a": 1}, {"a": "x", "b": 1}, {"d": 1, "a": 1}]),
    ("not propertyNames: a name it rejects is required", {"type": "object", "patternProperties": {"^[0-9]+$": {"type": "boolean"}},
                                                         "not": {"propertyNames": {"not": {"const": "0"}}}},
     [{"0": True}, {"0": False, "12": True}], [{}, {"1": True}, {"0": 1}]),
    ("not a false patternProperty: a name it matches is required", {"type": "object", "properties": {"x": {"type": "integer"}, "y": {}},
                                                                    "not": {"patternProperties": {"^x$": False}}},
     [{"x": 1}, {"x": 2, "y": 0}], [{}, {"y": 1}, {"x": "s"}]),
    ("not both of two properties: no second", {"type": "object", "properties": OBJ_AB, "not": {"required": ["a", "b"]}},
     [{"a": 1}, {}], [{"a": 1, "b": 1}]),
    ("if/then/else: then and a narrowed else", {"type": "object", "properties": {"k": {"enum": ["a", "b", "c"]}, "n": {"type": "integer"}},
                                                  "required": ["k", "n"], "if": {"properties": {"k": {"const": "a"}}},
                                                  "then": {"properties": {"n": {"minimum": 10}}}, "else": {"properties": {"n": {"maximum": 0}}}},
     [{"k": "a", "n": 10}, {"k": "b", "n": 0}, {"k": "c", "n": -1}], [{"k": "a", "n": 0}, {"k": "b", "n": 10}]),
    ("if/then per discriminator (allOf)", {"type": "object", "properties": {"k": {"type": "string"}, "n": {}}, "required": ["k", "n"], "allOf": [
        {"if": {"properties": {"k": {"const": "i"}}, "required": ["k"]}, "then": {"properties": {"n": {"type": "integer"}}}},
        {"if": {"properties": {"k": {"const": "s"}}, "required": ["k"]}, "then": {"properties": {"n": {"type": "string"}}}}]},
     [{"k": "i", "n": 1}, {"k": "s", "n": "x"}], [{"k": "i", "n": "x"}, {"k": "s", "n": 1}]),
    ("if alone constrains nothing", {"type": "integer", "if": {"minimum": 3}}, [1, 5], ["x"]),
    ("dependencies: the dependency is required", {"type": "object", "properties": OBJ_AB, "dependencies": {"a": ["b"]}, "$schema": D7},
     [{"b": 1}, {"a": 1, "b": 2}], [{"a": 1}]),
    ("dependentRequired", {"type": "object", "properties": OBJ_AB, "dependentRequired": {"a": ["b"]}}, [{"a": 1, "b": 2}], [{"a": 1}]),
    ("dependentSchemas merged", {"type": "object", "properties": OBJ_AB, "dependentSchemas": {"a": {"properties": {"b": {"minimum": 5}}}}},
     [{"a": 1, "b": 5}, {"b": 6}], [{"a": 1, "b": 4}]),
    ("dependentSchemas unsatisfiable: never the property", {"type": "object", "properties": OBJ_AB,
                                                            "dependentSchemas": {"a": {"properties": {"b": {"type": "string"}}, "required": ["b"]}}},
     [{"b": 1}, {}], [{"a": 1, "b": 1}, {"a": 1}]),
    ("allOf merged", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"properties": {"b": {"type": "string"}}, "required": ["b"]}]}, [{"a": 1, "b": "x"}], [{"a": 1}, {"b": "x"}]),
    ("allOf of patterns, one naming a few strings", {"type": "string", "allOf": [{"pattern": "^(ab|cd|ef)$"}, {"pattern": "^[a-d]"}]},
     ["ab", "cd"], ["ef", "x"]),
    ("anyOf of patterns with a pattern that only one can meet", {"type": "string", "pattern": "^x[0-9]+$",
                                                                 "anyOf": [{"pattern": "^y+$"}, {"pattern": "^x1$"}]},
     ["x1"], ["x2", "y1", "x12"]),
    ("oneOf with one branch", {"oneOf": [{"type": "integer"}], "minimum": 2}, [2], [1, "x"]),
    ("allOf bounds", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, [3], [2]),
    ("anyOf with siblings", {"type": "object", "properties": OBJ_AB, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, [{"a": 1}, {"b": 1}], [{}]),
    ("allOf of anyOfs", {"allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, {"anyOf": [{"type": "string"}, {"type": "null"}]}]}, ["x"], [1, None]),
    ("oneOf disjoint types", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, [1, "x"], [True]),
    ("oneOf discriminator", {"oneOf": [
        {"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k", "x"]},
        {"type": "object", "properties": {"k": {"const": "b"}, "y": {"type": "string"}}, "required": ["k", "y"]},
    ]}, [{"k": "a", "x": 1}, {"k": "b", "y": "s"}], [{"k": "a", "y": "s"}]),
    ("oneOf: an optional discriminator becomes required", {"type": "object", "oneOf": [
        {"properties": {"k": {"enum": ["a"]}, "x": {"type": "integer"}}},
        {"properties": {"k": {"enum": ["b"]}, "x": {"type": "string"}}},
    ]}, [{"k": "a", "x": 1}, {"k": "b"}], [{}, {"x": 1}, {"k": "a", "x": "s"}]),
    ("oneOf: a branch never produces what another requires", {"type": "object", "properties": {"s": {}, "u": {}},
                                                               "additionalProperties": False,
                                                               "oneOf": [{"required": ["s"]}, {"required": ["u"]}]},
     [{"s": 1}, {"u": 1}], [{"s": 1, "u": 1}, {}]),
    ("oneOf open objects: each closed without what the other requires", {"oneOf": [
        {"type": "object", "properties": {"x": {}}, "required": ["x"], "additionalProperties": True},
        {"type": "object", "properties": {"y": {}}, "required": ["y"], "additionalProperties": True},
    ]}, [{"x": 1}, {"y": 1}], [{"x": 1, "y": 1}, {}]),
    ("oneOf: a branch that cannot be narrowed is left out", {"oneOf": [
        {"type": "object", "properties": {"x": {}}, "required": ["x"], "additionalProperties": True, "minProperties": 1},
        {"type": "object", "properties": {"y": {}}, "required": ["y"]},
    ]}, [{"y": 1}], [{"x": 1, "y": 1}, {}]),
    ("oneOf of closed objects: each branch requires a property the others forbid", {"oneOf": [
        {"type": "object", "additionalProperties": False, "properties": {"env": {"type": "string"}}},
        {"type": "object", "additionalProperties": False, "properties": {"file": {"type": "string"}}}]},
     [{"env": "x"}, {"file": "y"}], [{}, {"env": "x", "file": "y"}]),
    ("oneOf sharing null: each branch less the types the other allows", {"oneOf": [{"type": ["string", "null"]}, {"type": ["integer", "null"]}]},
     ["1Gi", 3], [None, 1.5]),
    ("oneOf of arrays told apart by their first item", {"oneOf": [
        {"type": "array", "items": {"type": "integer"}, "minItems": 1}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]},
     [[1, 2], ["a"]], [[], [1, "a"], ["a", 1]]),
    ("oneOf of patterns: each leaves out a character the other needs", {"oneOf": [
        {"type": "string", "pattern": "^[^:]+:[^:]+$"}, {"type": "string", "pattern": "^[^@]+@[^@]+$"}]},
     ["a:b", "a@b"], ["a:b@c", "ab"]),
    ("oneOf with a union for a branch: the union's branches, each narrowed", {"oneOf": [
        {"oneOf": [{"type": "string"}, {"type": "object", "additionalProperties": False, "properties": {"secure": {"type": "string"}}}]},
        {"type": "object", "additionalProperties": False, "properties": {"global": {"type": "string"}}}]},
     ["x", {"secure": "s"}, {"global": "g"}], [{}, {"secure": "s", "global": "g"}, 1]),
    ("not a pattern beside a pattern: its first characters left out", {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_]*$",
                                                                       "not": {"pattern": "^([Bb][Uu][Ii][Ll][Dd]|[Bb][Kk])"}},
     ["deploy_key", "a1"], ["bk_x", "Build", "1a", ""]),
    ("oneOf by required properties", {"oneOf": [
        {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]},
    ]}, [{"x": 1}, {"y": 1}], [{"x": 1, "y": 1}, {}]),
    ("$ref with siblings (2020-12)", {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 3}, [3], [2]),
    ("$ref siblings ignored (draft-07)", {"$schema": D7, "definitions": {"x": {"type": "integer"}}, "$ref": "#/definitions/x", "minimum": 3}, [2], ["x"]),
    ("recursive $ref", {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}}, [{"c": [{"c": []}]}], [{"c": [1]}]),
    ("patternProperties", {"type": "object", "properties": {"b": {"type": "string"}}, "patternProperties": {"^x$": {"type": "integer"}}}, [{"b": "s", "x": 1}], [{"x": "s"}]),
    ("patternProperties over a declared name", {"type": "object", "properties": {"xa": {"type": "integer"}}, "patternProperties": {"^x.*": {"minimum": 3}}},
     [{"xa": 3}, {"xa": 4, "xb": 5}], [{"xa": 2}, {"xb": 2}, {"xb": "s"}, Raw('{"xa":3,"xa":2}')]),
    ("two patternProperties: both schemas", {"type": "object", "patternProperties": {"^a.*": {"type": "integer"}, ".*b$": {"minimum": 3}}},
     [{"ab": 3}, {"a": 4}, {"b": 5}], [{"ab": 2}, {"a": "s"}, {"c": 1}]),
    ("patternProperties names a required property", {"type": "object", "patternProperties": {"^r": {"type": "integer"}}, "required": ["r1"]},
     [{"r1": 1}], [{}, {"r1": "s"}]),
    ("allOf with patternProperties on one side", {"type": "object", "allOf": [
        {"patternProperties": {"^x.*": {"type": "integer"}}, "additionalProperties": False},
        {"properties": {"xa": {"minimum": 2}, "q": {}}}]}, [{"xa": 2}, {"xb": 3}], [{"xa": 1}, {"q": 1}, {"xb": "s"}]),
    ("draft-04 $id is not a keyword", {"$schema": D4, "definitions": {"i": {"type": "integer"}}, "type": "object",
                                       "properties": {"a": {"$id": "/elsewhere", "type": "object", "properties": {"b": {"$ref": "#/definitions/i"}}}}},
     [{"a": {"b": 1}}], [{"a": {"b": "s"}}]),
    ("pattern with optional group (xgrammar bug worked around)", {"type": "string", "pattern": "^a(b[01]+)?$"}, ["a", "ab01"], ["a0", "a01"]),
    ("pattern implies length", {"type": "string", "pattern": "^[a-z]{3}$", "minLength": 1, "maxLength": 5}, ["abc"], ["ab"]),
    ("^X*$ pattern with lengths", {"type": "string", "pattern": "^[0-9a-z-]*$", "minLength": 2, "maxLength": 3}, ["ab", "a-1"], ["a", "abcd", "A1"]),
    ("prefix then ^X*$ with lengths", {"type": "string", "pattern": "^(id|key)-[0-9]*$", "minLength": 5, "maxLength": 6},
     ["id-12", "key-12"], ["id-1234", "key-123", "id-", "x-12"]),
    # a search, anchored (narrower) before its bounds are dropped: llguidance would search, and write "abcdefgh"
    ("unanchored pattern with bounds", {"type": "string", "pattern": "[a-z]{2}", "maxLength": 4},
     ["ab"], ["abcdefgh", "1ab2x", "12"]),
    ("long maxLength folded and capped", {"type": "string", "pattern": "^[a-z]*$", "maxLength": 100000}, ["abc"], ["A"]),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": {"type": "integer"}}, [{"a": 1}], [{"b": 1}]),
    ("unevaluatedProperties false", {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False}, [{"a": 1}], [{"a": 1, "b": 1}]),
    ("unknown keyword ignored", {"type": "integer", "x-widget": "slider", "nullable": True}, [1], [None]),
    ("const in draft-04 is not a keyword", {"$schema": D4, "type": "integer", "const": 3}, [4], ["x"]),
    # narrower: the ':' both lookaheads need is left out of the string
    ("negative lookaheads", {"type": "string", "pattern": "^(?!aws:)(?!memorydb:)[a-z:]{1,12}$"},
     ["a", "bws", "memory"], ["aws:x", "memorydb:a", ""]),
    ("negative lookahead + length", {"type": "string", "pattern": "^(?!aws:)[a-z:]+$", "maxLength": 6},
     ["abc", "bws"], ["aws:x", "abcdefg", ""]),
    ("length lookahead", {"type": "string", "pattern": "^(?=.{2,4}$)[a-z]+$", "maxLength": 3},
     ["ab", "abc"], ["a", "abcd", "A1"]),
]

LLGUIDANCE = [
    # (name, schema, valid instances, invalid instances): refused by the xgrammar path
    # xgrammar 0.2.9 lets a raw '"' through a wide class repeated {0,1000}: such bounds are not folded
    ("wide class keeps its bounds", {"type": "string", "pattern": "^\\P{C}*$", "maxLength": 1000},
     ["a b"], [Raw('"a"b"')]),
    ("multipleOf on numbers", {"type": "number", "multipleOf": 0.5}, [1.5, 2, -0.5], [1.25, 0.3]),
    ("multipleOf fractional step", {"type": "integer", "multipleOf": 2.5}, [5, 10, 0], [2, 7]),
    ("pattern + length", {"type": "string", "pattern": "^(a|bc)+$", "maxLength": 4}, ["abc", "bcbc", "aaaa"],
     ["aaaaa", "bcbca", "b", ""]),
    ("format + pattern", {"type": "string", "format": "email", "pattern": "^a"}, ["ab@example.com"],
     ["b@example.com", "abc"]),
    ("format + length", {"type": "string", "format": "email", "maxLength": 8}, ["a@bc.de"],
     ["ab@cd.efgh", "abcde"]),
    ("anchor $ref", {"$defs": {"a": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, [3], ["s"]),
    ("allOf conflicting patterns", {"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]},
     ["ab", "axb"], ["a", "b", "ba"]),
    ("minProperties via undeclared keys", {"type": "object", "additionalProperties": {"type": "integer"},
                                           "minProperties": 2}, [{"a": 1, "b": 2}], [{"a": 1}, {}, {"a": "s", "b": 1}]),
    # llguidance refuses these as written (`not`, `uniqueItems`): it gets them narrowed as for xgrammar
    ("pattern + length beside a not", {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^(a|bc)+$", "maxLength": 4},
        "n": {"type": "integer", "not": {"const": 3}}}, "required": ["id", "n"]},
     [{"id": "abc", "n": 4}, {"id": "aaaa", "n": 9}],
     [{"id": "aaaaa", "n": 4}, {"id": "a", "n": 3}, {"id": "a", "n": 4, "more": 1}]),
    ("pattern + length beside uniqueItems", {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^(a|bc)+$", "maxLength": 4},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}, "required": ["id"]},
     [{"id": "bc", "tags": ["x"]}, {"id": "a"}], [{"id": "bcbca"}, {"id": "a", "tags": ["x", "x"]}]),
]

REFUSED = [
    ("not", {"not": {"type": "string", "pattern": "^a"}}, "not"),
    ("not integer of a number", {"type": "number", "not": {"type": "integer"}}, "not"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2}, "uniqueItems"),
    ("maxContains below maxItems", {"type": "array", "contains": {"const": 5}, "maxContains": 1}, "contains"),
    ("minContains above maxItems", {"type": "array", "contains": {"const": 5}, "minContains": 3, "maxItems": 2},
     "contains"),
    ("oneOf overlapping", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ("if/then/else with no outcome", {"if": {"type": "string"}, "then": False, "else": False}, "if/then/else"),
    ("unsupported format", {"type": "string", "format": "iri"}, "format:iri"),
    ("remote $ref", {"$ref": "https://example.com/s.json"}, "$ref:remote"),
    ("unresolvable $ref", {"$ref": "#/$defs/missing"}, "$ref"),
    ("two patternProperties, no common value", {"type": "object", "patternProperties": {"^a.*": {"type": "string"}, ".*b$": {"type": "integer"}}}, "patternProperties"),
    ("patternProperties with a propertyNames pattern", {"type": "object", "patternProperties": {"^a": {}}, "propertyNames": {"pattern": "^ab"}},
     "patternProperties"),
    ("propertyNames union: a declared name only its second branch allows", {"type": "object", "properties": {"9": {}},
                                                                              "propertyNames": {"anyOf": [{"pattern": "^[a-z]+$"}, {"pattern": "^[0-9]+$"}]}},
     "propertyNames"),
    ("propertyNames clash", {"type": "object", "properties": {"b": {}}, "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ("empty enum after filtering", {"type": "integer", "enum": ["a", "b"]}, "unsatisfiable"),
    ("allOf recursion", {"$defs": {"x": {"additionalProperties": {"$ref": "#/$defs/y"}}, "y": {"additionalProperties": {"$ref": "#/$defs/x"}}},
                         "allOf": [{"$ref": "#/$defs/x"}, {"$ref": "#/$defs/y"}]}, "allOf:recursive"),
    ("allOf disjoint types", {"allOf": [{"type": "integer"}, {"type": "string"}]}, "unsatisfiable"),
    ("invalid schema", {"type": "strng"}, "invalid-schema"),
    ("positive lookahead", {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"}, "lookaround"),
    ("unknown $schema", {"$schema": "http://example.com/my-draft", "type": "string"}, "$schema"),
    ("unsatisfiable", {"type": "integer", "minimum": 5, "maximum": 3}, "invalid-json_schema"),
]


@pytest.mark.parametrize(("name", "schema", "valid", "invalid", "backend"),
                         [(*c, "xgrammar") for c in OK] + [(*c, "llguidance") for c in LLGUIDANCE],
                         ids=[c[0] for c in OK + LLGUIDANCE])
def test_enforced_exactly(compiler, name, schema, valid, invalid, backend):
    compiled = compiler.compile(GrammarSpec.json_schema(schema))
    assert compiled.backend == backend
    for instance in valid:
        assert accepts(compiled, instance, compiler.tokenizer), f"{name}: valid {instance!r} refused"
    for instance in invalid:
        assert not accepts(compiled, instance, compiler.tokenizer), f"{name}: invalid {instance!r} accepted"


@pytest.mark.parametrize(("name", "schema", "feature"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_with_feature(compiler, name, schema, feature):
    with pytest.raises(GrammarError) as info:
        compiler.compile(GrammarSpec.json_schema(schema))
    assert info.value.feature == feature, f"{name}: {info.value.message}"
    assert info.value.message  # a sentence for the client, not an empty 400


def test_invalid_schema_message_names_the_place(compiler):
    with pytest.raises(GrammarError, match=r"at properties/a/type: 'strng' is not valid"):
        compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "strng"}}}))
