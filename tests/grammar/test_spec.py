"""GrammarSpec: request fields -> spec, validation messages, stable keys."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest

from moeserve.grammar import GrammarError, GrammarSpec

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_response_format_json_schema():
    spec = GrammarSpec.from_request(
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    )
    assert spec.kind == "json_schema"
    assert json.loads(spec.value) == SCHEMA


def test_response_format_json_object_and_text():
    assert GrammarSpec.from_request(response_format={"type": "json_object"}) == GrammarSpec("json_object")
    assert GrammarSpec.from_request(response_format={"type": "text"}) is None
    assert GrammarSpec.from_request() is None


def test_vllm_extras():
    assert GrammarSpec.from_request(guided_regex=r"\d+") == GrammarSpec("regex", r"\d+")
    assert GrammarSpec.from_request(guided_grammar='root ::= "a"').kind == "ebnf"
    assert GrammarSpec.from_request(guided_choice=["yes", "no"]).choices == ["yes", "no"]
    assert GrammarSpec.from_request(guided_json=SCHEMA) == GrammarSpec.json_schema(SCHEMA)
    assert GrammarSpec.from_request(guided_json=json.dumps(SCHEMA)).kind == "json_schema"
    # response_format "text" may accompany a guided_* field
    assert GrammarSpec.from_request(response_format={"type": "text"}, guided_regex="a").kind == "regex"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "object or a boolean"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "strict"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}}, "name"),
        ({"guided_choice": []}, "at least one choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice[1]"),
        ({"guided_choice": ["a", ""]}, "guided_choice[1] is empty"),
        ({"guided_choice": "ab"}, "list of strings"),
        ({"guided_regex": ""}, "empty regex"),
        ({"guided_regex": 5}, "guided_regex must be a string"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_json": "[1]"}, "object or a boolean"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "at most one"),
    ],
)
def test_malformed_fields_name_the_problem(fields, message):
    with pytest.raises(GrammarError, match=message.replace("[", r"\[").replace("]", r"\]")):
        GrammarSpec.from_request(**fields)


def test_constructor_validates():
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("yaml", "x")  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="takes no value"):
        GrammarSpec("json_object", "{}")
    with pytest.raises(GrammarError, match="needs its value"):
        GrammarSpec("regex", None)
    with pytest.raises(GrammarError, match="not JSON-serialisable"):
        GrammarSpec.json_schema({"x": object()})


def test_key_is_stable_and_distinguishes():
    a = GrammarSpec.json_schema(SCHEMA)
    assert a.key == GrammarSpec.json_schema(dict(SCHEMA)).key
    assert a.key.startswith("json_schema:")
    reordered = {"required": ["name"], **{k: v for k, v in SCHEMA.items() if k != "required"}}
    assert GrammarSpec.json_schema(reordered).key != a.key  # key order is output order: not the same grammar
    assert GrammarSpec.regex("a").key != GrammarSpec.ebnf("a").key
    # sha256 of kind and value: the same in every process and run (no hash() randomisation)
    assert GrammarSpec.regex("a").key == "regex:" + hashlib.sha256(b"regex\0a").hexdigest()[:32]


def test_spec_and_error_pickle():
    spec = GrammarSpec.choice(["a", "b"])
    spec.key  # noqa: B018 - cached before pickling
    assert pickle.loads(pickle.dumps(spec)) == spec
    err = pickle.loads(pickle.dumps(GrammarError("bad", feature="not")))
    assert (err.message, err.feature) == ("bad", "not")
