"""``epdserve serve --stream-interval 4`` through the official client: after the first read,
chunks of at least 4 tokens; the text is the non-streamed answer's."""

from __future__ import annotations

import pytest
from serving_support import API_KEY, ServerProcess


@pytest.fixture(scope="module")
def chunked(models):
    srv = ServerProcess(str(models.get("llama")), "--stream-interval", "4")
    yield srv
    srv.stop()


def test_tokens_stream_in_chunks_of_the_interval(chunked):
    from openai import OpenAI

    client = OpenAI(base_url=chunked.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    args = dict(model="tiny", prompt="one two three", max_tokens=18, temperature=0)
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})
    stream = client.completions.create(
        **args,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    text, counts = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            counts.append(chunk.usage.completion_tokens)
    sizes = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    assert text == whole.choices[0].text
    assert counts[-1] == 18
    # the first read takes what is there (tokens the API process had not read yet come
    # together), each later one waits for 4 (the unit tests pin the exact rule)
    assert all(size >= 4 for size in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + -(-17 // 4)  # 18 tokens: the first read, then at most five
