"""Tool-call parsers: whole outputs, and the same outputs streamed in random pieces."""

from __future__ import annotations

import json
import random

import pytest

from epdserve.engine.entrypoints.openai.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedCall,
    RequiredCalls,
)
from epdserve.engine.entrypoints.openai.tool_parsers.scanner import CallScanner


def streamed(parser, text: str, seed: int):
    """Feeds ``text`` in random pieces; returns (content, [(name, arguments)], deltas) as a
    client putting the deltas together sees them."""
    rng, pos, content, calls, deltas = random.Random(seed), 0, "", {}, []
    steps = []
    while pos < len(text):
        size = rng.randint(1, 7)
        steps.append(parser.stream(text[pos : pos + size]))
        pos += size
    steps.append(parser.finish())
    for step in steps:
        content += step.content
        for d in step.tool_calls:
            deltas.append(d)
            if "id" in d:
                assert d["index"] not in calls, "a call announced twice"
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls))), "indices 0, 1, ... in order"
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


def whole(parser, text: str):
    found = parser.extract(text)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in found.calls]
    return found.content, calls


def same_calls(a, b) -> bool:
    """Same names, and arguments that are the same JSON (formatting may differ)."""
    return [(n, json.loads(x)) for n, x in a] == [(n, json.loads(x)) for n, x in b]


LLAMA_CALLS = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '<|python_tag|>{"name": "f", "arguments": {"a": [1, {"b": "}]"}]}}',
        [("f", {"a": [1, {"b": "}]"}]})],
    ),
    (
        '  {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "\\"q\\" ;"}}',
        [("a", {}), ("b", {"x": '"q" ;'})],
    ),
    ('{"parameters": {"n": -1.5e2}, "name": "late_name"}', [("late_name", {"n": -150.0})]),
    ('{"name": "u", "parameters": {"s": "caf\\u00e9 ünï"}}', [("u", {"s": "café ünï"})]),
]


@pytest.mark.parametrize("text,expected", LLAMA_CALLS)
def test_llama3_whole_output_gives_its_calls_and_no_content(text, expected):
    content, calls = whole(Llama3JsonParser(), text)
    assert content is None
    assert [(n, json.loads(a)) for n, a in calls] == expected


@pytest.mark.parametrize("text,expected", LLAMA_CALLS)
@pytest.mark.parametrize("seed", range(4))
def test_llama3_streamed_in_random_pieces_gives_the_same_calls(text, expected, seed):
    content, calls, _ = streamed(Llama3JsonParser(), text, seed)
    assert content == ""
    assert [(n, json.loads(a)) for n, a in calls] == expected


NOT_CALLS = [
    "Hello there, no tools today.",
    "The set {1, 2} is small.",
    '{"name": "f" "parameters": {"a": 1}}',  # malformed JSON
    '{"name": f, "parameters": {}}',
    '{"title": "no name", "parameters": {}}',
    '{"name": 3, "parameters": {}}',
    '{"name": "no_arguments"}',
    "   ",
    "<|python_tag",
]


@pytest.mark.parametrize("text", NOT_CALLS)
@pytest.mark.parametrize("seed", range(3))
def test_llama3_text_that_is_not_calls_stays_content_whole_and_streamed(text, seed):
    assert whole(Llama3JsonParser(), text) == (text, [])
    content, calls, _ = streamed(Llama3JsonParser(), text, seed)
    assert (content, calls) == (text, [])


def test_a_call_cut_off_is_content_whole_but_was_already_announced_in_a_stream():
    text = '{"name": "f", "parameters": {"a": 1}'  # max_tokens ended it
    assert whole(Llama3JsonParser(), text) == (text, [])
    assert streamed(Llama3JsonParser(), text, 0)[:2] == ("", [("f", '{"a": 1}')])


def test_a_whole_output_with_arguments_that_are_not_json_is_content():
    text = '{"name": "f", "parameters": {"a": 1,}}'
    assert whole(Llama3JsonParser(), text) == (text, [])
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>'
    assert whole(HermesParser(), text) == (text, [])


def test_llama3_a_malformed_second_call_leaves_the_whole_output_as_content():
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {oops}}'
    assert whole(Llama3JsonParser(), text) == (text, [])


def test_llama3_text_after_the_calls_is_content_whole_and_streamed():
    text = '{"name": "a", "parameters": {"x": 1}}; Done.'
    content, calls = whole(Llama3JsonParser(), text)
    assert content == "Done." and same_calls(calls, [("a", '{"x": 1}')])
    content, s_calls, _ = streamed(Llama3JsonParser(), text, 1)
    assert content == "Done." and same_calls(s_calls, calls)


HERMES = [
    ('<tool_call>\n{"name": "a", "arguments": {"q": 1}}\n</tool_call>', None, [("a", {"q": 1})]),
    (
        'Let me look.\n<tool_call>{"name": "a", "arguments": {"s": "</tool_call>"}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        "Let me look.\n",
        [("a", {"s": "</tool_call>"}), ("b", {})],
    ),
    ('<tool_call>{"name": "c", "arguments": {"deep": [[{}]]}}', None, [("c", {"deep": [[{}]]})]),
]


@pytest.mark.parametrize("text,content,expected", HERMES)
@pytest.mark.parametrize("seed", range(4))
def test_hermes_blocks_give_calls_and_the_text_before_them_whole_and_streamed(
    text, content, expected, seed
):
    w_content, w_calls = whole(HermesParser(), text)
    assert w_content == content
    assert [(n, json.loads(a)) for n, a in w_calls] == expected
    s_content, s_calls, _ = streamed(HermesParser(), text, seed)
    assert s_content == (content or "")
    assert [(n, json.loads(a)) for n, a in s_calls] == expected


@pytest.mark.parametrize(
    "text",
    [
        "Plain answer with a < sign and <tool_ca",
        "x <tool_call>{bad json}</tool_call>",
        '<tool_call>{"name": "a"}</tool_call>',
        '<tool_call>{"name": "a" "arguments": {"q": 1}}</tool_call>',
        'a <tool_call>[{"name": "a", "arguments": {}}]</tool_call>',
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_hermes_text_without_a_wellformed_call_stays_content(text, seed):
    assert whole(HermesParser(), text) == (text, [])
    content, calls, _ = streamed(HermesParser(), text, seed)
    assert (content, calls) == (text, [])


def test_hermes_needs_special_tokens_kept_and_llama3_does_not():
    assert HermesParser.needs_special_tokens and not Llama3JsonParser.needs_special_tokens


def test_a_stream_announces_each_call_once_then_sends_argument_pieces():
    text = '{"name": "a", "parameters": {"x": "long value here"}}; {"name": "b", "parameters": {}}'
    _, _, deltas = streamed(Llama3JsonParser(), text, 5)
    firsts = [d for d in deltas if "id" in d]
    assert [d["index"] for d in firsts] == [0, 1]
    for d in firsts:
        assert d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
        assert set(d["function"]) == {"name", "arguments"}
    assert firsts[0]["id"] != firsts[1]["id"]
    for d in deltas:
        if "id" not in d:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
    assert len([d for d in deltas if d["index"] == 0]) > 2  # the arguments came in pieces


REQUIRED = '[{"name": "a", "parameters": {"x": [1, "]"]}}, {"name": "b", "parameters": {}}]'


@pytest.mark.parametrize("seed", range(4))
def test_required_array_gives_every_call_whole_and_streamed(seed):
    expected = [("a", '{"x": [1, "]"]}'), ("b", "{}")]
    content, calls = whole(RequiredCalls(), REQUIRED)
    assert content is None and same_calls(calls, expected)
    content, s_calls, _ = streamed(RequiredCalls(), REQUIRED, seed)
    assert content == "" and same_calls(s_calls, expected)


def test_required_output_that_is_not_an_array_of_calls_gives_no_calls():
    for text in ('{"name": "a", "parameters": {}}', '[{"name": "a"}]', "[{", ""):
        assert whole(RequiredCalls(), text) == (None, [])


@pytest.mark.parametrize("seed", range(3))
def test_named_choice_output_is_the_arguments_of_that_function(seed):
    text = '{"city": "Oslo", "days": 3}'
    assert whole(NamedCall("forecast"), text) == (None, [("forecast", text)])
    content, calls, deltas = streamed(NamedCall("forecast"), text, seed)
    assert (content, calls) == ("", [("forecast", text)])
    assert deltas[0]["id"].startswith("chatcmpl-tool-")
    assert whole(NamedCall("forecast"), "  ") == (None, [])


def test_the_scanner_reads_an_object_once_and_stops_at_its_end():
    s = CallScanner()
    assert s.feed('{"name": "f", "arguments": {"a": "}"}') == 37
    assert not s.done and s.name == "f" and s.arguments_text() == '{"a": "}"}'
    assert s.feed("} trailing") == 1
    assert s.closed and s.args_end == len(s.text) - 1
