"""Structured-output and tool fields against a real ``epdserve serve``, through the official
``openai`` client: a bad constraint is a 400 in OpenAI's shape naming the field, before any
token is generated (streaming too); a valid one is accepted. (Whether the output matches is
the engine core's test.)"""

from __future__ import annotations

import json
import re

import openai
import pytest

pytest.importorskip("xgrammar")

MESSAGES = [{"role": "user", "content": "give me a number"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}


def bad_request(call, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        call(model="tiny", max_tokens=4, **kwargs)
    body = err.value.body
    assert err.value.status_code == 400 and body["type"] == "BadRequestError"
    return body


def test_an_unenforceable_schema_keyword_is_named_with_its_field(client):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    body = bad_request(
        client.chat.completions.create,
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    )
    assert body["param"] == "response_format.json_schema.schema"
    assert "unsupported JSON schema keyword 'uniqueItems' at #/properties/tags" in body["message"]


def test_a_schema_too_costly_or_too_deep_to_build_is_refused_before_building(client):
    costly = {"type": "string", "pattern": "(a|b|c){1,5000}"}  # 15 s of xgrammar's time
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    for schema, fragment in ((costly, "'pattern' at #"), (deep, "deeper than 64")):
        rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        body = bad_request(client.chat.completions.create, messages=MESSAGES, response_format=rf)
        assert body["param"] == "response_format.json_schema.schema" and fragment in body["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
    ],
)
def test_a_bad_constraint_on_a_completion_is_a_400_naming_the_field(client, extra, param):
    body = bad_request(client.completions.create, prompt="x", extra_body=extra)
    assert body["param"] == param and body["message"].startswith(param + ":")


def test_a_streamed_request_with_a_bad_schema_fails_before_its_stream(client):
    body = bad_request(
        client.chat.completions.create,
        messages=MESSAGES,
        stream=True,
        extra_body={"structured_outputs": {"json": {"type": "integer", "not": {"const": 1}}}},
    )
    assert body["param"] == "structured_outputs.json" and "'not'" in body["message"]


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([TOOL], {"type": "function", "function": {"name": "sub"}}, "tool_choice"),
        ([TOOL, TOOL], "none", "tools[1].function.name"),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "if": {}}},
                }
            ],
            "required",
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tool_fields_are_a_400_naming_the_field(client, tools, choice, param):
    body = bad_request(
        client.chat.completions.create, messages=MESSAGES, tools=tools, tool_choice=choice
    )
    assert body["param"] == param


def test_a_choice_answers_one_of_its_strings(client):
    out = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=16,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert out.choices[0].text in ("yes", "no") and out.choices[0].finish_reason == "stop"


def test_a_guided_regex_answers_in_its_language(client):
    out = client.completions.create(
        model="tiny", prompt="x", max_tokens=6, extra_body={"guided_regex": "[a-z]{1,3}-[0-9]"}
    )
    text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert re.fullmatch("[a-z]{1,3}-[0-9]", text) if finish == "stop" else finish == "length"
    assert re.fullmatch("[a-z]{0,3}-?[0-9]?", text)  # a cut-off answer is a prefix


def test_a_json_schema_completion_answers_a_matching_object(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    out = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=24,
        extra_body={"response_format": rf, "structured_outputs": {"disable_any_whitespace": True}},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text)["ok"], bool)


def test_a_valid_schema_is_accepted_on_a_streamed_chat(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=4,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
        },
    )
    finishes = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finishes[-1] in ("stop", "length")


def test_tools_with_tool_choice_none_are_accepted(client):
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, tools=[TOOL], tool_choice="none"
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert not out.choices[0].message.tool_calls
