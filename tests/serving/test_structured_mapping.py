"""Request fields → ``StructuredOutputsParams`` and the tool checks, without a server: what
each source maps to, and the 400s naming the field as the client wrote it."""

from __future__ import annotations

import pytest

from epdserve.engine.entrypoints.openai.errors import APIError
from epdserve.engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from epdserve.engine.entrypoints.openai.structured_request import (
    check_tool_parameters,
    structured_outputs_of,
    wants_structured_outputs,
)
from epdserve.engine.entrypoints.openai.tool_request import check_tools, forced_schema

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/city"}},
            "required": ["city"],
            "$defs": {"city": {"type": "string"}},
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "the time"}}


def params_of(**fields):
    return structured_outputs_of(CompletionRequest(prompt="x", **fields))


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as err:
        params_of(**fields)
    assert err.value.status == 400 and err.value.message.startswith(err.value.param + ":")
    return err.value


@pytest.mark.parametrize(
    "fields, kind, value",
    [
        (dict(response_format={"type": "json_object"}), "json_object", True),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            ),
            "json",
            SCHEMA,
        ),
        (dict(structured_outputs={"json": SCHEMA}), "json", SCHEMA),
        (dict(structured_outputs={"regex": "[a-z]{3}"}), "regex", "[a-z]{3}"),
        (dict(structured_outputs={"choice": ["yes", "no"]}), "choice", ["yes", "no"]),
        (dict(structured_outputs={"grammar": 'root ::= "a"'}), "grammar", 'root ::= "a"'),
        (dict(guided_json=SCHEMA, guided_decoding_backend="xgrammar"), "json", SCHEMA),
        (dict(guided_regex="\\d+"), "regex", "\\d+"),
        (dict(guided_choice=["a", "b"]), "choice", ["a", "b"]),
        (dict(guided_grammar='root ::= "b"'), "grammar", 'root ::= "b"'),
    ],
)
def test_each_source_maps_to_its_kind(fields, kind, value):
    params = params_of(**fields)
    assert params.kind == kind and getattr(params, kind) == value


def test_text_and_absent_fields_constrain_nothing():
    assert params_of(response_format={"type": "text"}) is None
    assert params_of() is None and not wants_structured_outputs(CompletionRequest(prompt="x"))


def test_options_ride_along_with_a_response_format():
    params = params_of(
        response_format={"type": "json_object"},
        structured_outputs={"disable_any_whitespace": True, "disable_fallback": True},
    )
    assert params.json_object and params.disable_any_whitespace


def test_the_legacy_structural_tag_becomes_triggered_tags():
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    params = params_of(response_format=tag)
    fmt = params.structural_tag["format"]
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<f>"]
    assert fmt["tags"][0]["content"] == {"type": "json_schema", "json_schema": SCHEMA}


@pytest.mark.parametrize(
    "fields, param, fragment",
    [
        (dict(response_format={"type": "json_schema"}), "response_format", "'json_schema' field"),
        (dict(response_format={"type": "yaml"}), "response_format.type", "'yaml'"),
        (
            dict(response_format={"type": "json_object", "x": 1}),
            "response_format.x",
            "unrecognized",
        ),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
            "response_format.json_schema.name",
            "non-empty",
        ),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
            "response_format.json_schema.schema",
            "required",
        ),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "wat"}},
                }
            ),
            "response_format.json_schema.schema",
            "wat",
        ),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "array", "uniqueItems": True}},
                }
            ),
            "response_format.json_schema.schema",
            "unsupported JSON schema keyword 'uniqueItems' at #",
        ),
        (dict(structured_outputs={"regex": "(["}), "structured_outputs.regex", "Unclosed"),
        (dict(structured_outputs={"grammar": "root ::= "}), "structured_outputs.grammar", "EBNF"),
        (dict(structured_outputs={"choice": []}), "structured_outputs.choice", "non-empty"),
        (
            dict(structured_outputs={"json": "{not json"}),
            "structured_outputs.json",
            "not valid JSON",
        ),
        (
            dict(structured_outputs={"regex": "a", "choice": ["a"]}),
            "structured_outputs.choice",
            "only one",
        ),
        (
            dict(structured_outputs={"disable_any_whitespace": True}),
            "structured_outputs",
            "exactly one",
        ),
        (
            dict(structured_outputs={"regex": "a", "backend": "x"}),
            "structured_outputs.backend",
            "unrecognized",
        ),
        (
            dict(structured_outputs={"regex": "a", "whitespace_pattern": " "}),
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        (
            dict(structured_outputs={"regex": "a", "disable_any_whitespace": "yes"}),
            "structured_outputs.disable_any_whitespace",
            "bool",
        ),
        (dict(guided_json={"type": "nope"}), "guided_json", "nope"),
        (
            dict(
                structured_outputs={
                    "structural_tag": {
                        "type": "structural_tag",
                        "format": {
                            "type": "json_schema",
                            "json_schema": {"type": "integer", "not": {}},
                        },
                    }
                }
            ),
            "structured_outputs.structural_tag",
            "unsupported JSON schema keyword 'not' at #",
        ),
        (
            dict(guided_regex="a", guided_decoding_backend="outlines"),
            "guided_decoding_backend",
            "xgrammar",
        ),
        (
            dict(guided_regex="a", guided_whitespace_pattern=" "),
            "guided_whitespace_pattern",
            "not supported",
        ),
        (
            dict(response_format={"type": "json_object"}, guided_regex="a"),
            "guided_regex",
            "response_format already gives one",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field(fields, param, fragment):
    err = refused(**fields)
    assert err.param == param and fragment in err.message


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_required_forces_an_array_of_calls_with_the_defs_at_the_root():
    tools = check_tools([WEATHER, NOW], "required", False)
    schema = forced_schema(tools)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["$defs"] == {"city": {"type": "string"}}
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["weather"], ["now"]]
    assert "$defs" not in branches[0]["properties"]["parameters"]
    assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    params = structured_outputs_of(chat(tools=[WEATHER, NOW]), schema)
    assert params.kind == "json" and params.json == schema
    assert "maxItems" not in forced_schema(check_tools([WEATHER, NOW], "required", None))


def test_a_named_choice_forces_that_functions_parameters():
    choice = {"type": "function", "function": {"name": "weather"}}
    tools = check_tools([NOW, WEATHER], choice, None)
    assert tools.forced and forced_schema(tools) == WEATHER["function"]["parameters"]


def test_tools_without_a_choice_mean_auto_and_none_is_not_forced():
    auto = check_tools([WEATHER], None, None)
    assert (auto.tool_choice, auto.parallel_tool_calls, auto.forced) == ("auto", True, False)
    none = check_tools([WEATHER], "none", False)
    assert none.tools == [WEATHER] and not none.forced and not none.parallel_tool_calls
    assert check_tools(None, None, None).tools is None


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([], None, "tools"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([{"function": {"name": ""}}], None, "tools[0].function.name"),
        ([{"function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
        (None, "required", "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
        ([WEATHER], {"type": "function", "function": "weather"}, "tool_choice.function"),
        ([WEATHER], {"type": "function", "function": {}}, "tool_choice.function.name"),
    ],
)
def test_bad_tool_fields_are_a_400_naming_the_field(tools, choice, param):
    with pytest.raises(APIError) as err:
        check_tools(tools, choice, None)
    assert err.value.param == param


def test_a_forced_tools_bad_schema_names_that_tool():
    bad = {
        "type": "function",
        "function": {"name": "b", "parameters": {"type": "object", "not": {}}},
    }
    with pytest.raises(APIError) as err:
        check_tool_parameters(check_tools([WEATHER, bad], "required", None))
    assert err.value.param == "tools[1].function.parameters" and "'not'" in err.value.message
    check_tool_parameters(
        check_tools([WEATHER, bad], {"type": "function", "function": {"name": "weather"}}, None)
    )


def test_a_forced_choice_and_a_response_format_are_two_constraints():
    schema = forced_schema(check_tools([WEATHER], "required", None))
    with pytest.raises(APIError) as err:
        structured_outputs_of(
            chat(tools=[WEATHER], response_format={"type": "json_object"}), schema
        )
    assert err.value.param == "tool_choice"
