"""A real ``epdserve serve`` process driven with the official ``openai`` client."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI
from serving_support import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}

PROMPT = "def fibonacci(n):\n    "


def test_completion_returns_text_usage_and_finish_reason(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert isinstance(choice.text, str) and choice.text


def test_chat_completion_uses_the_chat_template(client, server):
    messages = [{"role": "user", "content": "hello"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    tokenized = httpx.post(
        server.url + "/tokenize", json={"messages": messages}, headers=AUTH
    ).json()
    assert out.usage.prompt_tokens == tokenized["count"]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
        }
    ]
    again = client.chat.completions.create(
        model="tiny", messages=parts, max_tokens=5, temperature=0
    )
    assert again.choices[0].message.content == out.choices[0].message.content


def test_streamed_text_equals_non_streamed_text_for_the_same_seed(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.9, seed=11)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    for chunk in chunks:
        if chunk.usage:
            usage = chunk.usage
        pieces.extend(c.text for c in chunk.choices)
    assert "".join(pieces) == whole
    assert usage is not None and usage.completion_tokens == 24


def test_chat_stream_starts_with_the_role_and_ends_with_finish_reason(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert text == whole.choices[0].message.content


def test_n_choices_with_a_seed_are_reproducible(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, n=3, seed=5)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1


def test_completion_logprobs_have_top_entries(client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(value)
        assert token in top
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs_have_top_logprobs(client):
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)


def test_stop_string_truncates_the_text(client):
    full = (
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
        .choices[0]
        .text
    )
    stop = full[4:7]
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop]
    ).choices[0]
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop"


def test_echo_prepends_the_prompt(client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    assert out.choices[0].text.startswith(PROMPT)


def test_cached_tokens_are_reported_for_a_repeated_prompt(client):
    prompt = "x = 1\n" * 40
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens >= 16


def test_models_tokenize_detokenize_version(server):
    models = httpx.get(
        server.url + "/v1/models", headers={"Authorization": "Bearer test-key"}
    ).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    text = httpx.post(
        server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH
    ).json()["prompt"]
    assert text == PROMPT
    assert "version" in httpx.get(server.url + "/version").json()


def test_32_concurrent_streams_complete_and_leave_nothing_behind(server):
    async def main():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="test-key", max_retries=0)
        prompts = [f"# task {i}\n" + "def f(x):\n" * (1 + i % 5) for i in range(32)]

        async def one(prompt):
            stream = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        streamed = await asyncio.gather(*(one(p) for p in prompts))
        whole = await asyncio.gather(
            *(
                client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
                for p in prompts
            )
        )
        await client.close()
        return streamed, [w.choices[0].text for w in whole]

    streamed, whole = asyncio.run(main())
    assert streamed == whole and all(streamed)
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    assert server.metric("vllm:generation_tokens_total") >= 32 * 12
    assert server.metric("vllm:time_to_first_token_seconds_count") >= 32


def test_client_disconnect_mid_stream_frees_the_request(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=30,
        headers={"Authorization": "Bearer test-key"},
        json={
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
    ) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 3:
                break
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metric("vllm:num_requests_running") > 0:
        time.sleep(0.1)
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
