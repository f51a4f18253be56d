"""The independent judge of constrained outputs: does `text` satisfy `spec`?

Used by tests and benches, never by the serving path. It shares no code with xgrammar: JSON is
parsed by `json`, schemas checked by `jsonschema` (the schema's own draft, formats asserted, with
strict RFC-based format checks defined here; a schema's patterns by the `regex` package, which reads
ECMA-262's Unicode property classes as Python's `re` does not), regexes by `re.fullmatch`. EBNF has no judge here.
"""

from __future__ import annotations

import datetime
import json
import re
from fractions import Fraction
from functools import lru_cache
from typing import Any

import jsonschema
import regex

from moeserve.grammar.schema_drafts import schema_draft
from moeserve.grammar.spec import GrammarSpec


def check_output(spec: GrammarSpec, text: str) -> str | None:
    """None if `text` satisfies `spec`, else a short reason. EBNF specs always pass (see above)."""
    if spec.kind in ("json_object", "json_schema"):
        try:
            value = json.loads(text, parse_constant=_reject_constant)
        except ValueError as e:
            return f"not JSON: {e}"
        if spec.kind == "json_object":
            return None if isinstance(value, dict) else f"not a JSON object: {type(value).__name__}"
        error = jsonschema.exceptions.best_match(_validator(spec.value).iter_errors(value))
        return None if error is None else f"schema violation at {'/'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
    if spec.kind == "regex":
        return None if re.fullmatch(spec.value, text) else "does not fully match the regex"
    if spec.kind == "choice":
        return None if text in spec.choices else "not one of the choices"
    return None


@lru_cache(maxsize=64)
def _validator(schema_text: str) -> jsonschema.protocols.Validator:
    schema = json.loads(schema_text)
    cls = schema_draft(schema).validator
    return _oracle_class(cls)(schema, format_checker=FORMAT_CHECKER)


@lru_cache(maxsize=8)
def _oracle_class(cls: type) -> type:
    """`cls` whose multipleOf uses exact arithmetic where jsonschema's float division overflows, and whose
    pattern keywords search with the `regex` package."""
    float_check = cls.VALIDATORS["multipleOf"]

    def multiple_of(validator, step, instance, schema):
        try:
            yield from float_check(validator, step, instance, schema)
        except OverflowError:
            if Fraction(str(instance)) % Fraction(str(step)):
                yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {step}")

    def pattern(validator, pat, instance, schema):
        if validator.is_type(instance, "string") and not regex.search(pat, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pat!r}")

    def pattern_properties(validator, patterns, instance, schema):
        if validator.is_type(instance, "object"):
            for pat, sub in patterns.items():
                for key in (k for k in instance if regex.search(pat, k)):
                    yield from validator.descend(instance[key], sub, path=key, schema_path=pat)

    def additional_properties(validator, extra, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        declared, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
        extras = [k for k in instance if k not in declared and not any(regex.search(p, k) for p in patterns)]
        if validator.is_type(extra, "object"):
            for key in extras:
                yield from validator.descend(instance[key], extra, path=key)
        elif extra is False and extras:
            yield jsonschema.ValidationError(f"additional properties are not allowed ({sorted(extras)} unexpected)")

    return jsonschema.validators.extend(cls, {"multipleOf": multiple_of, "pattern": pattern,
                                              "patternProperties": pattern_properties,
                                              "additionalProperties": additional_properties})


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# -- formats -----------------------------------------------------------------------------

FORMAT_CHECKER = jsonschema.FormatChecker()

_DATE = r"(\d{4})-(\d{2})-(\d{2})"
_TIME = r"(\d{2}):(\d{2}):(\d{2})(?:\.\d+)?(?:[Zz]|([+-])(\d{2}):(\d{2}))"
_DUR_TIME = r"T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)"
_DURATION = rf"P(?:\d+W|(?:\d+Y(?:\d+M(?:\d+D)?)?|\d+M(?:\d+D)?|\d+D)(?:{_DUR_TIME})?|{_DUR_TIME})"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_URI_CHAR = r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})"
_VARCHAR = r"(?:[A-Za-z0-9_]|%[0-9A-Fa-f]{2})"
_VARSPEC = rf"{_VARCHAR}(?:\.?{_VARCHAR})*(?::[1-9]\d{{0,3}}|\*)?"
_TEMPLATE_LITERAL = r"(?:[^\x00-\x20\"'%<>\\^`{|}\x7f]|%[0-9A-Fa-f]{2})"
_TEMPLATE_EXPR = rf"\{{[+#./;?&=,!@|]?{_VARSPEC}(?:,{_VARSPEC})*\}}"
_POINTER = r"(?:/(?:[^~/]|~[01])*)*"


def _valid_date(y: str, m: str, d: str) -> bool:
    try:
        return bool(datetime.date(int(y), int(m), int(d)))
    except ValueError:
        return False


def _valid_time(groups: tuple) -> bool:
    hour, minute, second, _sign, off_h, off_m = groups
    if int(hour) > 23 or int(minute) > 59 or int(second) > 60:
        return False
    return off_h is None or (int(off_h) <= 23 and int(off_m) <= 59)


def _format(name: str, check) -> None:
    FORMAT_CHECKER.checks(name)(lambda v: not isinstance(v, str) or bool(check(v)))


_format("date", lambda v: (m := re.fullmatch(_DATE, v, re.ASCII)) and _valid_date(*m.groups()))
_format("time", lambda v: (m := re.fullmatch(_TIME, v, re.ASCII)) and _valid_time(m.groups()))
_format(
    "date-time",
    lambda v: (m := re.fullmatch(rf"{_DATE}[Tt]{_TIME}", v, re.ASCII))
    and _valid_date(*m.groups()[:3])
    and _valid_time(m.groups()[3:]),
)
_format("duration", lambda v: re.fullmatch(_DURATION, v, re.ASCII))
_format("hostname", lambda v: len(v.rstrip(".")) <= 253 and re.fullmatch(rf"{_LABEL}(?:\.{_LABEL})*\.?", v, re.ASCII))
_format("uri", lambda v: re.fullmatch(rf"[A-Za-z][A-Za-z0-9+.\-]*:{_URI_CHAR}*", v, re.ASCII))
_format("uri-reference", lambda v: re.fullmatch(rf"{_URI_CHAR}*", v, re.ASCII))
_format("uri-template", lambda v: re.fullmatch(rf"(?:{_TEMPLATE_LITERAL}|{_TEMPLATE_EXPR})*", v))
_format("json-pointer", lambda v: re.fullmatch(_POINTER, v))
_format("relative-json-pointer", lambda v: re.fullmatch(rf"(?:0|[1-9][0-9]*)(?:#|{_POINTER})", v))
