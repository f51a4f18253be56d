"""What a request asks its output to follow: `GrammarSpec`, built from OpenAI/vLLM fields.

A spec is small, frozen and picklable: it crosses process boundaries, and each process rebuilds the
compiled grammar from it. Request fields (at most one): `response_format` of type `text` (no
grammar), `json_object` or `json_schema` (`{"json_schema": {"name", "schema", "strict"}}`), and
vLLM's `guided_json`, `guided_regex`, `guided_grammar` (xgrammar EBNF, `root` rule), `guided_choice`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, get_args

from moeserve.grammar.errors import GrammarError

GrammarKind = Literal["json_object", "json_schema", "regex", "ebnf", "choice"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)


# Past these a grammar is refused before anyone compiles it: a schema nested twice as deep as any
# real one we know would only exercise recursion, and a regex's size bounds its compile time.
MAX_SCHEMA_DEPTH = 128  # the deepest of the 254 JSONSchemaBench conformance schemas: 63
MAX_REGEX_CHARS = 16 * 1024


@dataclass(frozen=True)
class GrammarSpec:
    """One output grammar. `value` is schema JSON text, a regex, EBNF text, or a JSON list of choices.
    Construction validates shape only; whether the grammar is supported is `GrammarCompiler.compile`'s call."""

    kind: GrammarKind
    value: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
        if self.kind == "json_object":
            if self.value is not None:
                raise GrammarError("a json_object grammar takes no value")
            return
        if not isinstance(self.value, str):
            raise GrammarError(f"a {self.kind} grammar needs its value as a string, got {type(self.value).__name__}")
        if self.kind in ("json_schema", "choice"):
            try:
                parsed = json.loads(self.value)
            except json.JSONDecodeError as e:
                what = "json_schema is not valid JSON" if self.kind == "json_schema" else "choice value is not a JSON list"
                raise GrammarError(f"{what}: {e}") from None
            if self.kind == "choice":
                _check_choices(parsed)
            elif not isinstance(parsed, (dict, bool)):
                raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(parsed).__name__}")
            elif _depth(parsed) > MAX_SCHEMA_DEPTH:
                raise GrammarError(f"json_schema is nested more than {MAX_SCHEMA_DEPTH} levels deep", feature="depth")
        elif self.value == "":
            raise GrammarError(f"empty {self.kind}")
        elif self.kind == "regex" and len(self.value) > MAX_REGEX_CHARS:
            raise GrammarError(f"regex is {len(self.value)} characters; the limit is {MAX_REGEX_CHARS}", feature="size")

    @cached_property
    def key(self) -> str:
        """Stable cache key: equal specs have equal keys, in every process and every run."""
        digest = hashlib.sha256(f"{self.kind}\0{self.value or ''}".encode()).hexdigest()
        return f"{self.kind}:{digest[:32]}"

    @property
    def choices(self) -> list[str]:
        """The choices of a `choice` spec."""
        if self.kind != "choice":
            raise AttributeError("only a choice grammar has choices")
        return json.loads(self.value)  # type: ignore[arg-type]

    # -- constructors --------------------------------------------------------------------

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> GrammarSpec:
        """From a schema dict (or JSON text). Key order is kept: it is the output's property order."""
        if isinstance(schema, str):
            return cls("json_schema", schema)
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"json_schema is not JSON-serialisable: {e}") from None
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        _check_choices(choices)
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def from_request(cls, *, response_format: Mapping[str, Any] | None = None,
                     guided_json: Mapping[str, Any] | str | None = None, guided_regex: str | None = None,
                     guided_grammar: str | None = None,
                     guided_choice: Sequence[str] | None = None) -> GrammarSpec | None:
        """The spec an OpenAI/vLLM-style request asks for, or None for free text. Raises GrammarError
        (-> HTTP 400) naming the field when a field is malformed or more than one grammar is requested."""
        fields = {"response_format": response_format, "guided_json": guided_json, "guided_regex": guided_regex,
                  "guided_grammar": guided_grammar, "guided_choice": guided_choice}
        given = {name: value for name, value in fields.items() if value is not None}
        if isinstance(response_format, Mapping) and response_format.get("type") == "text":
            given.pop("response_format")  # explicit "text" means no grammar; it may accompany a guided_* field
        if len(given) > 1:
            raise GrammarError(f"at most one structured-output field may be set, got {', '.join(sorted(given))}")
        if not given:
            return None
        if response_format is not None and "response_format" in given:
            return cls._from_response_format(response_format)
        if guided_json is not None:
            if not isinstance(guided_json, (Mapping, str, bool)):
                raise GrammarError("guided_json must be a JSON schema object or its JSON text")
            return cls.json_schema(guided_json)
        if guided_regex is not None:
            if not isinstance(guided_regex, str):
                raise GrammarError("guided_regex must be a string")
            return cls.regex(guided_regex)
        if guided_grammar is not None:
            if not isinstance(guided_grammar, str):
                raise GrammarError("guided_grammar must be a string (EBNF)")
            return cls.ebnf(guided_grammar)
        return cls.choice(guided_choice)  # type: ignore[arg-type]

    @classmethod
    def _from_response_format(cls, response_format: Mapping[str, Any]) -> GrammarSpec:
        if not isinstance(response_format, Mapping):
            raise GrammarError("response_format must be an object")
        kind = response_format.get("type")
        if kind == "json_object":
            return cls.json_object()
        if kind != "json_schema":
            raise GrammarError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        body = response_format.get("json_schema")
        if not isinstance(body, Mapping):
            raise GrammarError("response_format.json_schema must be an object with a 'schema' field")
        if body.get("name") is not None and not isinstance(body["name"], str):
            raise GrammarError("response_format.json_schema.name must be a string")
        if body.get("strict") is not None and not isinstance(body["strict"], bool):
            raise GrammarError("response_format.json_schema.strict must be a boolean")
        # The schema is always enforced; `strict` only says the client wants that, so it changes nothing here.
        if "schema" not in body:
            raise GrammarError("response_format.json_schema.schema is required")
        return cls.json_schema(body["schema"])


def _check_choices(choices: Any) -> None:
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise GrammarError("guided_choice must be a list of strings")
    if len(choices) == 0:
        raise GrammarError("guided_choice must list at least one choice")
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            raise GrammarError(f"guided_choice[{i}] must be a string, got {type(c).__name__}")
        if c == "":
            raise GrammarError(f"guided_choice[{i}] is empty; an empty completion cannot be a choice")


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (objects and arrays), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest
