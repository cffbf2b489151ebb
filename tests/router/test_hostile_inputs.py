"""Hostile request bodies through the real router: each gets a 4xx from exactly one pod
(or from the router itself), is never retried, and the router keeps serving.
STAND-IN pods (``standin_pod.py``) answer bad bodies with a 400, as engine pods do."""

from __future__ import annotations

import time

import httpx
import pytest

NESTED = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HUGE_INT = b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"
BODIES = {
    "malformed": b'{"prompt": "x",',
    "not_utf8": b'{"prompt": "\xff\xfe"}',
    "array": b"[1, 2, 3]",
    "string": b'"just a string"',
    "null": b"null",
    "empty": b"",
    "prompt_wrong_type": b'{"prompt": {"a": 1}}',
    "no_prompt": b'{"max_tokens": 2}',
    "deeply_nested": NESTED,
    "five_thousand_digit_int": HUGE_INT,
}


@pytest.fixture(scope="module")
def model_dir(models):
    return models.get("llama")


@pytest.fixture(scope="module")
def pods(module_spawn, model_dir):
    return [module_spawn.standin(model_dir) for _ in range(2)]


@pytest.fixture(scope="module")
def router(module_spawn, pods, model_dir):
    router = module_spawn.router(pods, "--model", str(model_dir))
    deadline = time.monotonic() + 20
    while httpx.get(router.url + "/ready", timeout=2).status_code != 200:
        assert time.monotonic() < deadline, "router never became ready"
        time.sleep(0.05)
    return router


def pod_requests(spawn, pods) -> float:
    return sum(spawn.metric(p.url, "standin:requests_total") for p in pods)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name", sorted(BODIES))
def test_a_hostile_body_gets_the_pods_400_from_one_pod(module_spawn, pods, router, name, path):
    before = pod_requests(module_spawn, pods)
    headers = {"content-type": "application/json"}
    r = httpx.post(router.url + path, content=BODIES[name], headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    assert pod_requests(module_spawn, pods) == before + 1


def test_the_router_keeps_serving_after_hostile_bodies(module_spawn, router):
    for body in BODIES.values():
        httpx.post(router.url + "/v1/completions", content=body, timeout=30)
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 200
    assert module_spawn.metric(router.url, "epdserve_router:upstream_retries_total") == 0
