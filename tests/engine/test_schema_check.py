"""``check_schema`` refuses exactly the JSON-schema keywords xgrammar would drop.

Each refused case carries the evidence: a JSON text that violates the schema yet the grammar
xgrammar builds accepts it (should a later xgrammar enforce one, its test fails and the rule
can go). Each allowed case shows the grammar rejecting a violating text.
"""

from __future__ import annotations

import json

import pytest

from epdserve.engine.structured.schema_check import MAX_NESTING, UnsupportedSchema, check_schema

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402


def accepts(schema: dict, text: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=True, strict_mode=True
    )
    return _is_grammar_accept_string(grammar, text)


INTS = {"type": "array", "items": {"type": "integer"}}
AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}

# (schema, a text that violates it, the keyword named, the pointer named)
REFUSED = [
    ({**INTS, "uniqueItems": True}, "[1, 1]", "uniqueItems", "#"),
    ({**INTS, "contains": {"const": 2}}, "[1]", "contains", "#"),
    ({**INTS, "contains": {"const": 2}, "minContains": 2}, "[2, 1]", "contains", "#"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf", "#"),
    ({"type": "number", "multipleOf": 3}, "4", "multipleOf", "#"),
    ({"multipleOf": 3}, "4", "multipleOf", "#"),
    (
        {"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
        "dependentRequired",
        "#",
    ),
    (
        {"type": "object", "properties": AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        '{"a": 1}',
        "dependentSchemas",
        "#",
    ),
    (
        {"type": "object", "properties": AB, "dependencies": {"a": ["b"]}},
        '{"a": 1}',
        "dependencies",
        "#",
    ),
    (
        {
            "type": "object",
            "properties": AB,
            "required": ["a", "b"],
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"properties": {"b": {"const": 1}}},
        },
        '{"a": 1, "b": 2}',
        "if",
        "#",
    ),
    ({"type": "integer", "not": {"const": 3}}, "3", "not", "#"),
    ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, '"maybe"', "allOf", "#"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcd"', "maxLength", "#"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"ab"', "minLength", "#"),
    (
        {"type": "string", "format": "uri", "maxLength": 12},
        '"http://a.b/cdefghijkl"',
        "maxLength",
        "#",
    ),
    ({"type": "string", "format": "idn-email"}, '"x"', "format", "#"),
    ({"type": "string", "format": "regex"}, '"("', "format", "#"),
    ({"minimum": 3}, "1", "minimum", "#"),
    ({"pattern": "^a$"}, '"b"', "pattern", "#"),
    ({"minItems": 2}, "[1]", "minItems", "#"),
    ({"required": ["a"]}, "{}", "required", "#"),
    ({"type": "integer", "minimum": 0, "anyOf": [{"type": "integer"}]}, "-1", "type", "#"),
    ({"type": "string", "anyOf": [{"type": "string"}, {"type": "integer"}]}, "1", "type", "#"),
    ({"enum": ["aa", "b"], "maxLength": 1}, '"aa"', "maxLength", "#"),
    (
        {
            "$defs": {"n": {"type": "object", "properties": AB}},
            "$ref": "#/$defs/n",
            "required": ["a"],
        },
        "{}",
        "required",
        "#",
    ),
    ({"$defs": {"n": {"$anchor": "nn", "type": "integer"}}, "$ref": "#nn"}, '"s"', "$ref", "#"),
    ({"$ref": "http://example.com/s.json"}, '"s"', "$ref", "#"),
    (
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 2},
        },
        '{"abc": 1}',
        "maxLength",
        "#/propertyNames",
    ),
    (
        {"$dynamicAnchor": "n", "type": "object", "properties": {"a": {"$dynamicRef": "#n"}}},
        '{"a": 1}',
        "$dynamicRef",
        "#/properties/a",
    ),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
        '{"a": 1}',
        "required",
        "#",
    ),
    (
        {
            "type": "object",
            "properties": {
                "x/y": {"type": "array", "items": {"type": "integer", "not": {"const": 1}}}
            },
        },
        '{"x/y": [1]}',
        "not",
        "#/properties/x~1y/items",
    ),
    (
        {
            "type": "object",
            "$defs": {"d": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
            "properties": {"a": {"$ref": "#/$defs/d"}},
        },
        '{"a": [1, 1]}',
        "uniqueItems",
        "#/$defs/d",
    ),
    (
        {
            "anyOf": [
                {"type": "integer"},
                {"type": "array", "prefixItems": [{"type": "string", "format": "iri"}]},
            ]
        },
        '["not an iri"]',
        "format",
        "#/anyOf/1/prefixItems/0",
    ),
]


@pytest.mark.parametrize("schema, violating, keyword, pointer", REFUSED)
def test_a_keyword_xgrammar_drops_is_named_with_its_pointer(schema, violating, keyword, pointer):
    assert accepts(schema, violating), "xgrammar now enforces this: drop the rule"
    with pytest.raises(UnsupportedSchema) as err:
        check_schema(schema)
    assert (err.value.keyword, err.value.pointer) == (keyword, pointer)
    assert f"unsupported JSON schema keyword '{keyword}' at {pointer}" in str(err.value)


# (schema, a text that violates it): xgrammar enforces these, so they pass the check
ALLOWED = [
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"type": ["integer", "null"], "multipleOf": 3}, "4"),
    ({**INTS, "uniqueItems": False, "minItems": 2, "maxItems": 3}, "[1]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, '["a"]'),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, "[1, 2]"),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"'),
    ({"type": "string", "pattern": "^[a-z]+$"}, '"ABC"'),
    ({"type": "string", "format": "email"}, '"nope"'),
    ({"type": "string", "format": "date-time", "title": "t", "description": "d"}, '"x"'),
    ({"type": "number", "minimum": 0, "exclusiveMaximum": 1}, "1"),
    ({"type": "object", "properties": AB, "required": ["a"]}, "{}"),
    ({"type": "object", "properties": AB, "unevaluatedProperties": False}, '{"a": 1, "c": 2}'),
    (
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
        '{"a": 1}',
    ),
    (
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"maxLength": 1},
        },
        '{"zz": 1}',
    ),
    (
        {
            "type": "object",
            "patternProperties": {"^x[0-9]$": {"type": "integer"}},
            "properties": {"a": {"type": "string"}},
        },
        '{"x1": "s"}',
    ),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
    ({"items": {"type": "integer"}, "minItems": 2}, "[1]"),
    (
        {
            "anyOf": [{"type": "integer", "minimum": 5}, {"type": "null"}],
            "default": None,
            "title": "x",
        },
        "3",
    ),
    (
        {
            "oneOf": [{"type": "integer"}, {"type": "string"}],
            "discriminator": {"propertyName": "k"},
        },
        "true",
    ),
    (
        {"allOf": [{"$ref": "#/$defs/n"}], "description": "d", "$defs": {"n": {"type": "integer"}}},
        '"s"',
    ),
    (
        {
            "$defs": {"n": {"type": "integer"}},
            "$ref": "#/$defs/n",
            "description": "x",
            "default": 1,
        },
        '"s"',
    ),
    ({"enum": ["a", "b"], "type": "string", "title": "E"}, '"c"'),
    (
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
        '{"kids": [1]}',
    ),
    (
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "urn:x",
            "$comment": "c",
            "type": "integer",
            "examples": [1],
            "deprecated": True,
            "readOnly": True,
            "writeOnly": False,
        },
        '"s"',
    ),
]


@pytest.mark.parametrize("schema, violating", ALLOWED)
def test_a_keyword_xgrammar_enforces_passes(schema, violating):
    assert not accepts(schema, violating)
    check_schema(schema)


def test_a_schema_nested_past_the_bound_is_refused_before_any_walk():
    schema: dict = {"type": "integer"}
    for _ in range(MAX_NESTING):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="deeper than"):
        check_schema(schema)
    check_schema(schema["items"]["items"])  # 62 levels: fine


def test_boolean_schemas_and_non_objects_are_left_to_the_backend():
    for schema in (True, False, {"type": "object", "properties": {"a": True}}, [1]):
        check_schema(schema)
