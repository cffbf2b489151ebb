"""Request features clients send, through the official ``openai`` client: vLLM's behaviour,
or a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

PROMPT = "def add(a, b):\n    return"


def test_logit_bias_forces_a_token(client, server):
    import httpx
    from serving_support import API_KEY

    forced = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={"300": 100},
        extra_body={"ignore_eos": True},
    )
    text = httpx.post(
        server.url + "/detokenize",
        json={"tokens": [300] * 4},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["prompt"]
    assert forced.choices[0].text == text and forced.usage.completion_tokens == 4


def test_chat_echo_continues_the_assistants_last_message(client):
    messages = [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "one two"},
    ]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=3,
        temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False},
    )
    assert out.choices[0].message.content.startswith("one two")


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    with_text = [c for c in chunks if c.choices]
    assert with_text and all(c.usage is not None for c in with_text)
    counts = [c.usage.completion_tokens for c in with_text]  # a chunk may carry 2+ tokens
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 5
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_n_min_tokens_and_ignore_eos_are_honoured(client):
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        n=3,
        seed=5,
        temperature=1.0,
        extra_body={"min_tokens": 6, "ignore_eos": True},
    )
    assert len(out.choices) == 3 and out.usage.completion_tokens == 18


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(response_format={"type": "json_schema"}), "response_format"),
        (dict(tools=[]), "tools"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(extra_body={"guided_whitespace_pattern": r"\s*"}), "guided_whitespace_pattern"),
    ],
)
def test_features_this_server_lacks_are_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kwargs
        )
    assert err.value.body["param"] == param


def test_suffix_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, suffix="x")
    assert err.value.body["param"] == "suffix"


def test_a_chat_prompt_processed_upstream_answers_like_the_messages(client, server):
    import httpx
    from serving_support import API_KEY

    messages = [{"role": "user", "content": "write a loop"}]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=auth).json()
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    given = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"processed_prompt": {"prompt_token_ids": ids["tokens"]}},
    )
    assert given.choices[0].message.content == plain.choices[0].message.content
    assert given.usage.prompt_tokens == plain.usage.prompt_tokens == ids["count"]


@pytest.mark.parametrize(
    "path, payload",
    [
        (
            "/v1/completions",
            {
                "prompt": PROMPT,
                "temperature": 0.0,
                "repetition_penalty": 1.0,
                "max_tokens": 5,
                "logprobs": None,
                "best_of": 1,
                "use_beam_search": False,
                "ignore_eos": True,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
                "temperature": 0.0,
                "max_completion_tokens": 5,
                "ignore_eos": True,
            },
        ),
    ],
)
def test_a_benchmark_clients_streaming_payload_is_served_as_is(server, path, payload):
    """The request shape of vLLM-style serving benchmarks (streamed, usage at the end)."""
    import json

    import httpx
    from serving_support import API_KEY

    body = {"model": "tiny", **payload, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True])
def test_fcfs_refuses_a_non_zero_priority_naming_it_and_takes_zero(client, stream):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            stream=stream,
            extra_body={"priority": 1},
        )
    assert err.value.body["param"] == "priority"
    assert "--scheduling-policy priority" in err.value.body["message"]
    out = client.completions.create(
        model="tiny", prompt="x", max_tokens=1, extra_body={"priority": 0, "ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"  # sampled: only ignore_eos rules out EOS
