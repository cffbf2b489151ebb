"""The cpu default KV block (128 tokens, chosen by measurement) as a user gets it: a real
``epdserve serve`` without ``--block-size``; prefix hits come in whole 128-token blocks."""

from __future__ import annotations

import httpx
import pytest

from tests.serving.serving_support import ServerProcess


@pytest.fixture(scope="module")
def default_server(models):
    # the suite runs with EPDSERVE_BLOCK_SIZE=16 (tests/conftest.py); empty counts as unset
    srv = ServerProcess(str(models.get("llama")), api_key=None, env={"EPDSERVE_BLOCK_SIZE": ""})
    yield srv
    srv.stop()


def cached_tokens(url: str, ids: list[int]) -> int:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prefix_hits_come_in_whole_128_token_blocks(default_server):
    long = [(7 * i) % 1000 + 10 for i in range(300)]
    assert cached_tokens(default_server.url, long) == 0
    assert cached_tokens(default_server.url, long) == 256  # two full blocks of 128


def test_a_prompt_shorter_than_one_block_gets_no_hit(default_server):
    short = [(11 * i) % 1000 + 10 for i in range(100)]
    cached_tokens(default_server.url, short)
    assert cached_tokens(default_server.url, short) == 0
