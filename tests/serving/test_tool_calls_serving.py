"""Tool calls through a real ``epdserve serve`` and the official ``openai`` client.

The tiny random model writes no tool calls by itself: ``required`` and named choices are
forced by their grammar, and ``auto`` is driven by a regex constraint that makes the model
write a Hermes ``<tool_call>`` block, which the server's parser then reads. A logit bias
against whitespace-only tokens keeps the forced JSON short (a random model otherwise fills
``max_tokens`` with the whitespace JSON allows).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from serving_support import API_KEY, ServerProcess
from tokenizers import Tokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]
MESSAGES = [{"role": "user", "content": "weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    days: int = pydantic.Field(ge=1, le=9)


@pytest.fixture(scope="module")
def no_spaces(models) -> dict:
    """logit_bias pushing every whitespace-only token down."""
    tok = Tokenizer.from_file(str(models.get("llama") / "tokenizer.json"))
    ids = [i for i in range(tok.get_vocab_size()) if not tok.decode([i]).strip()]
    return {str(i): -100 for i in ids}


def ask(client, no_spaces, **kw):
    kw = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, **kw}
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(logit_bias=no_spaces, **kw)


def valid_call(call) -> None:
    """A call of one of TOOLS whose arguments fit that tool's schema."""
    assert call.id.startswith("chatcmpl-tool-")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def valid_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_auto_tool_choice_without_the_tool_flags_is_a_400_naming_tool_choice(client):
    for choice in ({"tool_choice": "auto"}, {}):  # tools without a choice mean "auto"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=2, **choice
            )
        assert err.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in err.value.body["message"]


def test_a_named_choice_answers_one_valid_call_with_finish_stop(client, no_spaces):
    out = ask(client, no_spaces, tool_choice=NAMED).choices[0]
    assert out.finish_reason == "stop" and out.message.content == ""
    assert len(out.message.tool_calls) == 1
    valid_weather_call(out.message.tool_calls[0])


def test_required_answers_calls_with_finish_tool_calls(client, no_spaces):
    out = ask(client, no_spaces, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == ""
    (call,) = out.message.tool_calls
    valid_call(call)


def test_tool_choice_none_answers_plain_content(client, no_spaces):
    out = ask(client, no_spaces, tool_choice="none", max_tokens=5).choices[0]
    assert out.message.tool_calls is None and out.message.content


def test_streamed_call_deltas_put_together_by_the_client(client, no_spaces):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    kw.update(parallel_tool_calls=False, max_tokens=60, temperature=0, logit_bias=no_spaces)
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    deltas = [e for e in events if e.type == "chunk" and e.chunk.choices]
    tool_deltas = [d.chunk.choices[0].delta.tool_calls for d in deltas]
    first = next(t for t in tool_deltas if t)[0]
    assert first.index == 0 and first.id.startswith("chatcmpl-tool-") and first.type == "function"
    assert first.function.name in ("get_weather", "noop")
    assert sum(1 for t in tool_deltas if t) > 2  # the arguments came in pieces
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert call.id == first.id
    valid_call(call)


@pytest.mark.parametrize("parse", ["chat", "beta"])
def test_the_clients_parse_helpers_give_the_strict_tools_arguments_as_a_model(
    client, no_spaces, parse
):
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    assert tool["function"]["strict"] is True
    helper = client.chat.completions if parse == "chat" else client.beta.chat.completions
    out = helper.parse(
        model="tiny",
        messages=MESSAGES,
        tools=[tool],
        tool_choice=NAMED,
        max_tokens=60,
        temperature=0,
        logit_bias=no_spaces,
    )
    parsed = out.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 9 and len(parsed.city) <= 8


HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": [1-9]\}\}</tool_call>'


@pytest.fixture(scope="module")
def hermes(models):
    srv = ServerProcess(
        str(models.get("llama")), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    )
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    srv.stop()


def auto(hermes, **kw):
    body = {"structured_outputs": {"regex": HERMES_CALL}}
    return hermes.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=150, extra_body=body, **kw
    )


def test_auto_reads_the_parsers_format_into_tool_calls(hermes):
    out = auto(hermes, temperature=0).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    (call,) = out.message.tool_calls
    valid_weather_call(call)
    assert json.loads(call.function.arguments)["city"] == "Oslo"


def test_auto_streams_the_parsed_call_as_deltas(hermes):
    chunks = list(auto(hermes, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].id
    args = "".join(t.function.arguments or "" for t in calls)
    assert json.loads(args)["city"] == "Oslo"
    assert not "".join(d.content or "" for d in deltas)  # the block is not content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_text_that_is_no_call_stays_content(hermes):
    out = hermes.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4, temperature=0
    ).choices[0]
    assert out.message.tool_calls is None and out.message.content
    assert out.finish_reason == "length"
