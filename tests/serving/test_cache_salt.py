"""cache_salt through a real ``epdserve serve``: prompts share prefix-cache blocks only
within a salt, and the salted blocks' KV events index under the same salt in the router."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import zmq
from serving_support import ServerProcess

from epdserve.connectors.kv_events import EventDecoder
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys

BS = 16  # the server's block size


@pytest.fixture(scope="module")
def salt_server(models, tmp_path_factory):
    endpoint = f"ipc://{tmp_path_factory.mktemp('salt-events')}/ev.ipc"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    srv = ServerProcess(
        str(models.get("llama")), "--kv-events-config", json.dumps(config), api_key=None
    )
    srv.events_endpoint = endpoint
    yield srv
    srv.stop()


def complete(srv, prompt: list[int], salt: str | None) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    resp = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text


def hits_of(srv, prompt: list[int], salt: str | None) -> float:
    """Prefix-cache hits (tokens) the server counts for one request."""
    before = srv.metric("vllm:prefix_cache_hits_total")
    complete(srv, prompt, salt)
    return srv.metric("vllm:prefix_cache_hits_total") - before


def test_the_same_prompt_under_the_same_salt_hits_the_prefix_cache(salt_server):
    prompt = list(range(100, 150))  # 3 full blocks + 2 tokens
    assert hits_of(salt_server, prompt, "tenant-a") == 0
    assert hits_of(salt_server, prompt, "tenant-a") == 48


def test_the_same_prompt_under_another_salt_or_none_hits_nothing(salt_server):
    prompt = list(range(300, 350))
    assert hits_of(salt_server, prompt, "tenant-a") == 0
    assert hits_of(salt_server, prompt, "tenant-b") == 0
    assert hits_of(salt_server, prompt, None) == 0
    assert hits_of(salt_server, prompt, "tenant-a") == 48  # the blocks were there all along


def test_salted_block_events_index_under_the_salt_in_the_router(salt_server):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(salt_server.events_endpoint)
    try:
        time.sleep(0.5)  # let the subscription reach the publisher
        prompt = list(range(500, 550))
        complete(salt_server, prompt, "tenant-c")
        index, decoder = PrefixIndex(), EventDecoder()
        while sub.poll(3000):
            batch = decoder.decode(sub.recv_multipart()[2])
            index.apply("pod", batch)
            if index.pod_block_count("pod") >= 3:
                break
    finally:
        sub.close(linger=0)
        ctx.term()
    assert index.match(request_keys(prompt, BS, cache_salt="tenant-c"), ["pod"]) == {"pod": 3}
    assert index.match(request_keys(prompt, BS), ["pod"]) == {"pod": 0}
    assert index.match(request_keys(prompt, BS, cache_salt="tenant-d"), ["pod"]) == {"pod": 0}
