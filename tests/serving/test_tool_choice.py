"""How a chat answer's text becomes tool calls per tool_choice (messages, stream deltas,
finish reasons) and the tool flags of ``epdserve serve``."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from epdserve.common.cli_fields import add_fields, from_args
from epdserve.engine.entrypoints.openai.errors import APIError
from epdserve.engine.entrypoints.openai.tool_calls import check_tool_choice, choice_tools
from epdserve.engine.entrypoints.openai.tool_parsers import PARSERS
from epdserve.engine.entrypoints.serve_cli import TOOL_CALL_PARSERS, ServeOptions, add_arguments
from epdserve.engine.sampling_params import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALLS = '{"name": "f", "parameters": {"a": 1}}; {"name": "f", "parameters": {"a": 2}}'


def prep(choice="auto", tools=TOOLS, parallel=True, kind="chat"):
    # the request side's Prepared carries these three on top of its prompts and params
    return SimpleNamespace(
        kind=kind,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        params=SamplingParams(),
    )


def serving(parser="llama3_json"):
    return SimpleNamespace(tool_parser_name=parser)


def one(choice="auto", parser="llama3_json", parallel=True):
    tools = choice_tools(serving(parser), prep(choice, parallel=parallel), 1)
    return tools[0]


def test_auto_without_both_tool_flags_is_a_400_naming_tool_choice():
    with pytest.raises(APIError) as err:
        check_tool_choice(serving(None), prep("auto"))
    assert err.value.status == 400 and err.value.param == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in err.value.message
    with pytest.raises(APIError):
        check_tool_choice(serving(None), prep(None))  # tools without a choice: "auto"


def test_requests_that_need_no_parser_pass_without_the_flags():
    for p in (prep("none"), prep("required"), prep({"function": {"name": "f"}}), prep(tools=None)):
        check_tool_choice(serving(None), p)


def test_hermes_keeps_special_tokens_in_the_text_of_auto_requests():
    p = prep("auto")
    check_tool_choice(serving("hermes"), p)
    assert p.params.skip_special_tokens is False
    p = prep("auto")
    check_tool_choice(serving("llama3_json"), p)
    assert p.params.skip_special_tokens is True


def test_plain_answers_when_there_are_no_tools_or_choice_is_none():
    assert choice_tools(serving(), prep(tools=None), 1) is None
    assert choice_tools(serving(), prep("none"), 1) is None
    assert choice_tools(serving(), prep(kind="completion"), 1) is None


def test_auto_calls_make_tool_calls_null_content_and_finish_tool_calls():
    fields, finish = one().message(CALLS, "stop")
    assert finish == "tool_calls" and fields["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in fields["tool_calls"]] == [
        {"a": 1},
        {"a": 2},
    ]


def test_auto_text_without_calls_is_content_and_keeps_its_finish_reason():
    fields, finish = one().message("just words", "length")
    assert fields == {"content": "just words"} and finish == "length"


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    fields, _ = one(parallel=False).message(CALLS, "stop")
    assert len(fields["tool_calls"]) == 1
    tools = one(parallel=False)
    delta = tools.delta(CALLS, True)
    assert {d["index"] for d in delta["tool_calls"]} == {0}


def test_required_gives_the_array_as_calls_with_empty_content_and_finish_tool_calls():
    text = '[{"name": "f", "parameters": {"a": 1}}]'
    fields, finish = one("required").message(text, "stop")
    assert fields["content"] == "" and finish == "tool_calls"
    assert fields["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert one("required").message(text[:10], "length")[1] == "length"


def test_a_named_choice_is_one_call_with_finish_stop_as_vllm():
    fields, finish = one({"type": "function", "function": {"name": "f"}}).message(
        '{"a": 1}', "stop"
    )
    assert finish == "stop" and fields["content"] == ""
    assert fields["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_stream_deltas_and_finish_reasons_per_choice():
    tools = one()
    assert tools.delta('{"na', False) is None  # held back: maybe a call
    delta = tools.delta('me": "f", "parameters": {"a"', False)
    first = delta["tool_calls"][0]
    assert first["function"] == {"name": "f", "arguments": '{"a"'} and "content" not in delta
    assert tools.delta(": 1}}", True)["tool_calls"] == [
        {"index": 0, "function": {"arguments": ": 1}"}}
    ]
    assert tools.finish_reason("stop") == "tool_calls"
    assert tools.finish_reason("length") == "length"
    named = one({"type": "function", "function": {"name": "f"}})
    named.delta("{}", True)
    assert named.finish_reason("stop") == "stop"


def test_stream_text_that_is_not_a_call_is_content_and_finish_stays_stop():
    tools = one()
    assert tools.delta("Hi", False) == {"content": "Hi"}
    assert tools.delta("!", True) == {"content": "!"}
    assert tools.finish_reason("stop") == "stop"


def test_each_choice_has_its_own_parser():
    a, b = choice_tools(serving(), prep(), 2)
    assert a.parser is not b.parser


def options(argv, env=None):
    parser = argparse.ArgumentParser()
    add_fields(parser, ServeOptions, env or {})
    return from_args(ServeOptions, parser.parse_args(argv))


def test_auto_tool_choice_needs_both_flags_and_a_parser_alone_enables_nothing():
    opts = options(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert opts.auto_tool_parser == "hermes"
    assert options(["--tool-call-parser", "hermes"]).auto_tool_parser is None
    with pytest.raises(ValueError, match="enable_auto_tool_choice: requires --tool-call-parser"):
        options(["--enable-auto-tool-choice"])


def test_tool_flags_come_from_the_environment_too():
    env = {"EPDSERVE_ENABLE_AUTO_TOOL_CHOICE": "1", "EPDSERVE_TOOL_CALL_PARSER": "llama3_json"}
    assert options([], env).auto_tool_parser == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser: must be one of"):
        options([], {"EPDSERVE_TOOL_CALL_PARSER": "pythonic"})


def test_the_flag_choices_are_the_parsers_there_are():
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "mistral"])
