"""The real router's own guards: the API key on every route but the probes, the request
body limit (by Content-Length and while a chunked body arrives), and /tokenize proxying.
One STAND-IN pod (``standin_pod.py``) behind the router."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest

KEY = "s3cret-key"
LIMIT = 4096
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}


@pytest.fixture(scope="module")
def model_dir(models):
    return models.get("llama")


@pytest.fixture(scope="module")
def pod(module_spawn, model_dir):
    return module_spawn.standin(model_dir)


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 20
    while httpx.get(url + "/ready", timeout=2).status_code != 200:
        assert time.monotonic() < deadline, "router never became ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def guarded(module_spawn, pod):
    router = module_spawn.router([pod], "--api-key", KEY, "--max-body-bytes", str(LIMIT))
    wait_ready(router.url)
    return router


@pytest.fixture(scope="module")
def open_router(module_spawn, pod):
    router = module_spawn.router([pod])
    wait_ready(router.url)
    return router


ROUTES = [
    ("POST", "/v1/completions", BODY),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {KEY}", KEY])
@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_a_missing_or_wrong_key_gets_an_openai_401(guarded, method, path, body, auth):
    headers = {"Authorization": auth} if auth else {}
    r = httpx.request(method, guarded.url + path, json=body, headers=headers, timeout=10)
    assert r.status_code == 401
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_the_right_key_opens_every_route(guarded, method, path, body):
    r = httpx.request(method, guarded.url + path, json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/version"])
def test_probe_scrape_and_version_routes_need_no_key(guarded, path):
    assert httpx.get(guarded.url + path, timeout=10).status_code == 200


def test_the_clients_authorization_header_reaches_the_pod(guarded):
    r = httpx.post(guarded.url + "/v1/completions", json=BODY, headers=AUTH, timeout=10)
    assert r.json()["authorization"] == AUTH["Authorization"]


def test_a_body_over_the_limit_by_content_length_gets_413(guarded, pod, module_spawn):
    before = module_spawn.metric(pod.url, "standin:requests_total")
    big = {**BODY, "prompt": "x" * LIMIT}
    r = httpx.post(guarded.url + "/v1/completions", json=big, headers=AUTH, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert module_spawn.metric(pod.url, "standin:requests_total") == before


def test_a_chunked_body_over_the_limit_gets_413(guarded):
    def chunks():
        for _ in range(4):
            yield b"x" * (LIMIT // 2)

    r = httpx.post(guarded.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"


def test_a_chunked_body_under_the_limit_is_served(guarded):
    def chunks():
        yield b'{"prompt": "hello", '
        yield b'"max_tokens": 2}'

    r = httpx.post(guarded.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


def test_the_router_keeps_serving_after_rejecting_bodies(guarded):
    big = b"x" * (2 * LIMIT)
    for _ in range(3):
        httpx.post(guarded.url + "/v1/completions", content=big, headers=AUTH, timeout=10)
    r = httpx.post(guarded.url + "/v1/completions", json=BODY, headers=AUTH, timeout=10)
    assert r.status_code == 200


def test_tokenize_is_forwarded_to_a_pod(open_router, pod):
    r = httpx.post(open_router.url + "/tokenize", json={"prompt": "hello there"}, timeout=10)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    assert r.json()["pod"] == int(pod.url.rsplit(":", 1)[1])


def test_without_a_key_the_router_is_open(open_router):
    assert httpx.post(open_router.url + "/v1/completions", json=BODY, timeout=10).status_code == 200


def test_the_api_key_defaults_to_the_environment(monkeypatch):
    from epdserve.router.cli import add_arguments

    monkeypatch.setenv("EPDSERVE_API_KEY", "from-a-secret")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).api_key == "from-a-secret"
