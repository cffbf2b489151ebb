"""Structured outputs through a real ``epdserve serve`` and the official ``openai`` client:
chat ``response_format`` json_schema and completions ``structured_outputs`` (regex, choice,
a slice of the corpus), streamed and not, n > 1, logprobs. A finished choice is in its spec's
language; any other choice says ``length``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from serving_support import API_KEY, ServerProcess
from so_corpus import REGEXES, Spec, all_specs, check
from so_schemas import SCHEMAS

SPECS = all_specs()


@pytest.fixture(scope="module")
def server(models):
    srv = ServerProcess(str(models.get("llama")))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def verdicts(spec: Spec, texts_and_reasons, must_finish: bool = True) -> list[str]:
    """Failures among ``(text, finish_reason)`` pairs; asserts at least one finished."""
    pairs = list(texts_and_reasons)
    out = [f"{spec.name}: finish_reason {r!r}" for _, r in pairs if r not in ("stop", "length")]
    out += [
        f"{spec.name}: {t!r}: {why}"
        for t, r in pairs
        if r == "stop" and (why := check(spec, t)) is not None
    ]
    if must_finish:
        assert any(r == "stop" for _, r in pairs), f"{spec.name}: no choice finished: {pairs}"
    return out


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}  # fmt: skip


# response_format has no whitespace option (vLLM refuses structured_outputs options beside it),
# and in free whitespace a random model mostly runs on: these root values have no room for any
NO_ROOM_FOR_WHITESPACE = ["string_pattern_code", "enum_strings", "anyof_primitives"]


def spelled_by(tokens: list[str], text: str, finish_reason: str, model) -> bool:
    """The logprob entries' tokens spell the text; a stop token's entry comes last (as vLLM's)."""
    import json
    from pathlib import Path

    eos = json.loads((Path(model) / "tokenizer_config.json").read_text())["eos_token"]
    joined = "".join(tokens)
    return joined == text or (finish_reason, joined) == ("stop", text + eos)


@pytest.mark.parametrize("name", NO_ROOM_FOR_WHITESPACE)
def test_chat_json_schema_choices_validate_with_logprobs(client, models, name):
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Give me a {name} as JSON."}],
        response_format=json_schema_format(name),
        n=4,
        max_tokens=64,
        temperature=1.0,
        seed=7,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    spec = Spec(name, "json", SCHEMAS[name])
    pairs = [(c.message.content, c.finish_reason) for c in resp.choices]
    assert not verdicts(spec, pairs)
    for c in resp.choices:
        assert c.logprobs.content and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        tokens = [t.token for t in c.logprobs.content]  # ASCII only: one string per token
        assert spelled_by(tokens, c.message.content, c.finish_reason, models.get("llama"))


def test_chat_structured_outputs_json_stream_accumulates_to_valid_json(client):
    name = "record_user_profile"
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A user profile, please."}],
        extra_body={"structured_outputs": Spec(name, "json", SCHEMAS[name]).wire()},
        n=3,
        max_tokens=256,
        temperature=1.0,
        seed=11,
        stream=True,
    )
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert not verdicts(Spec(name, "json", SCHEMAS[name]), zip(texts, reasons, strict=True))


def test_chat_json_schema_with_free_whitespace_is_valid_or_cut(client):
    name = "chess_move"
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Your move."}],
        response_format=json_schema_format(name),
        n=4,
        max_tokens=64,
        temperature=1.0,
        seed=13,
    )
    spec = Spec(name, "json", SCHEMAS[name])
    pairs = [(c.message.content, c.finish_reason) for c in resp.choices]
    assert not verdicts(spec, pairs, must_finish=False)
    assert all(c.message.content.startswith("{") for c in resp.choices)
    assert resp.usage.completion_tokens <= 4 * 64


def test_completions_regex_with_logprobs(client, models):
    regex = REGEXES["iso_date"][0]
    resp = client.completions.create(
        model="tiny",
        prompt="Today is",
        n=3,
        max_tokens=32,
        temperature=1.0,
        seed=5,
        logprobs=2,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    spec = Spec("regex:iso_date", "regex", regex)
    assert not verdicts(spec, [(c.text, c.finish_reason) for c in resp.choices])
    for c in resp.choices:
        assert spelled_by(c.logprobs.tokens, c.text, c.finish_reason, models.get("llama"))
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)


def test_completions_choice_streamed(client):
    choices = ["positive", "negative", "neutral"]
    stream = client.completions.create(
        model="tiny",
        prompt="The review was",
        n=4,
        max_tokens=16,
        temperature=1.0,
        seed=9,
        stream=True,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    texts, reasons = [""] * 4, [None] * 4
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert all(r == "stop" for r in reasons) and all(t in choices for t in texts)


def test_a_slice_of_the_corpus_served_concurrently(client):
    specs = [s for s in SPECS if s.must_finish][::3]  # every kind, ~25 specs, one batch

    def ask(spec: Spec):
        resp = client.completions.create(
            model="tiny",
            prompt="Output:",
            n=2,
            max_tokens=256,
            temperature=1.0,
            seed=3,
            extra_body={"structured_outputs": spec.wire()},
        )
        return spec, [(c.text, c.finish_reason) for c in resp.choices]

    with ThreadPoolExecutor(len(specs)) as pool:
        results = list(pool.map(ask, specs))
    assert {s.kind for s, _ in results} == {"json", "regex", "choice", "grammar"}
    failures = [f for spec, pairs in results for f in verdicts(spec, pairs)]
    assert not failures, "\n".join(failures)
