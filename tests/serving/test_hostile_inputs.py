"""Every hostile input gets a 4xx naming what is wrong, from a pod and through the router;
afterwards the pod's engine core is the same process and still serves."""

from __future__ import annotations

import httpx
import pytest
from hostile_inputs import AUTH, KEYED, TABLE, assert_intact, check, colliding_request_ids, send

NORMAL = {"model": "tiny", "prompt": "x = 1", "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("target", ["pod", "router"])
def test_every_hostile_input_gets_a_4xx_and_leaves_the_pod_intact(server, router, target):
    """Each case: its 4xx naming the field, then the same engine core, a normal request
    answered and no request or KV block left behind."""
    pods, url = {"pod": server}, server.url if target == "pod" else router
    cores = {"pod": server.core_pid()}
    assert len(TABLE) >= 25
    for case in [*TABLE, *KEYED]:
        check(send(url, case), case)
        assert_intact(case.name, pods, cores, url, "/v1/completions", NORMAL)
    colliding_request_ids(url, "/v1/completions", NORMAL)
    assert_intact("colliding X-Request-Id headers", pods, cores, url, "/v1/completions", NORMAL)


@pytest.mark.parametrize("target", ["pod", "router"])
def test_a_chunked_body_past_the_limit_is_a_413(server, router, target):
    url = server.url if target == "pod" else router

    def endless():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * (1 << 20)
        yield b'"}'

    resp = httpx.post(
        url + "/v1/completions",
        content=endless(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413


def test_the_api_key_guards_tokenize_but_not_the_probes(server):
    body = {"prompt": "hello"}
    assert httpx.post(server.url + "/tokenize", json=body).status_code == 401
    assert httpx.post(server.url + "/tokenize", json=body, headers=AUTH).status_code == 200
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200, path
