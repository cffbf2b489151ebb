"""Structured outputs and forced tool calls through a P/D pool: the real router in P/D mode
over a real prefill and decode pod (KV over a real redis-server), driven by the official
``openai`` client. The decode pod samples the first token itself, so its grammar shapes the
whole answer."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pd_support import PDRouter

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "temp": {"type": "integer", "minimum": -50, "maximum": 60},
    },
    "required": ["city", "temp"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model rambles


@pytest.fixture(scope="module")
def client(models, redis_pods):
    router = PDRouter(str(models.get("llama")), redis_pods.prefill, redis_pods.decode)
    yield openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    router.stop()


def chat(client, **kwargs):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    return client.chat.completions.create(model="tiny", messages=messages, **kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    kwargs = dict(response_format=fmt, max_tokens=60, seed=5, temperature=1.0, extra_body=COMPACT)
    if stream:
        chunks = list(chat(client, stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = chat(client, **kwargs).choices[0]
        text, reason = choice.message.content, choice.finish_reason
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_named_tool_call_validates_against_its_parameters(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = chat(client, tools=[TOOL], tool_choice=choice, max_tokens=60, extra_body=COMPACT)
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])


def test_a_bad_schema_is_a_400_naming_the_field(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, response_format=fmt)
    assert "response_format.json_schema.schema" in str(err.value)
