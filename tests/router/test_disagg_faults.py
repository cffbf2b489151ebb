"""The retry policy of the real router's P/D orchestration, over STAND-IN pods.

A prefill pod's own answer (4xx, 500) goes to the client and the decode pod never sees
the request; a prefill pod that refuses it (503) is skipped and the decode pod computes
the prompt itself. Plain requests of a P/D pool (models, tokenize, unparsable bodies)
go to a decode pod."""

from __future__ import annotations

import time

import httpx
import pytest

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}


@pytest.fixture(scope="module")
def model_dir(models):
    return models.get("llama")


def flag(pod) -> str:
    return f"{pod.url},events={pod.extra['events']},replay={pod.extra['replay']}"


def pd_router(spawn, prefill, decode, encoder=None, model=None):
    flags = ["--prefill-endpoint", flag(prefill), "--decode-endpoint", flag(decode)]
    if model is not None:
        flags += ["--model", str(model)]
    if encoder is not None:
        flags += ["--encoder-endpoint", flag(encoder)]
    router = spawn.router([], *flags)
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(router.url + "/ready", timeout=2)
        if r.status_code == 200 and r.json()["pods"] == 2 + (encoder is not None):
            return router
        assert time.monotonic() < deadline, "router never became ready"
        time.sleep(0.05)


def requests(spawn, pod) -> float:
    return spawn.metric(pod.url, "standin:requests_total")


@pytest.mark.parametrize("status", [400, 500])
def test_a_prefill_error_answer_goes_to_the_client_not_to_decode(spawn, model_dir, status):
    prefill, decode = spawn.standin(model_dir, fail_status=status), spawn.standin(model_dir)
    router = pd_router(spawn, prefill, decode)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == status and r.json() == {"error": "stand-in told to fail"}
    assert requests(spawn, prefill) == 1 and requests(spawn, decode) == 0


def test_a_prefill_pod_answering_503_leaves_the_prompt_to_decode(spawn, model_dir):
    prefill, decode = spawn.standin(model_dir, fail_status=503), spawn.standin(model_dir)
    router = pd_router(spawn, prefill, decode)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 200 and r.json()["pod"] == int(decode.url.rsplit(":", 1)[1])


def test_a_decode_error_answer_is_returned_from_one_decode_pod(spawn, model_dir):
    prefill, decode = spawn.standin(model_dir), spawn.standin(model_dir, fail_status=500)
    router = pd_router(spawn, prefill, decode)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 500 and requests(spawn, decode) == 1


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/models", None, 200),
        ("POST", "/tokenize", b'{"prompt": "hi"}', 200),
        ("POST", "/v1/completions", b"[1, 2]", 400),
    ],
)
def test_plain_requests_of_a_pd_pool_go_to_a_decode_pod(
    spawn, model_dir, method, path, body, status
):
    prefill, decode = spawn.standin(model_dir), spawn.standin(model_dir)
    router = pd_router(spawn, prefill, decode)
    r = httpx.request(method, router.url + path, content=body, timeout=10)
    assert r.status_code == status, r.text
    assert requests(spawn, prefill) == 0 and requests(spawn, decode) == 1


def test_with_every_decode_pod_down_a_prefill_pod_answers_models_and_tokenize(spawn, model_dir):
    prefill, decode = spawn.standin(model_dir), spawn.standin(model_dir)
    router = pd_router(spawn, prefill, decode)
    decode.kill()
    deadline = time.monotonic() + 20
    while httpx.get(router.url + "/ready", timeout=2).status_code != 503:  # scraped as down
        assert time.monotonic() < deadline, "the router never saw the decode pod go"
        time.sleep(0.05)
    assert httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
    r = httpx.post(router.url + "/tokenize", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 200 and r.json()["pod"] == int(prefill.url.rsplit(":", 1)[1])


IMAGE_CHAT = {
    "model": "tiny",
    "max_tokens": 2,
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "what is this?"},
            ],
        }
    ],
}


def test_an_encoder_error_answer_goes_to_the_client(spawn, model_dir):
    encoder = spawn.standin(model_dir, fail_status=500)
    prefill, decode = spawn.standin(model_dir), spawn.standin(model_dir)
    router = pd_router(spawn, prefill, decode, encoder)
    r = httpx.post(router.url + "/v1/chat/completions", json=IMAGE_CHAT, timeout=10)
    assert r.status_code == 500 and requests(spawn, encoder) == 1
    assert requests(spawn, prefill) == 0 and requests(spawn, decode) == 0


def test_an_encoder_answering_503_is_skipped(spawn, model_dir):
    encoder = spawn.standin(model_dir, fail_status=503)
    prefill, decode = spawn.standin(model_dir), spawn.standin(model_dir)
    router = pd_router(spawn, prefill, decode, encoder)
    r = httpx.post(router.url + "/v1/chat/completions", json=IMAGE_CHAT, timeout=10)
    assert r.status_code == 200, r.text
    assert requests(spawn, encoder) == 1 and requests(spawn, decode) == 1


def test_both_legs_get_the_prompt_as_the_router_tokenized_it(spawn, model_dir):
    prefill, decode = spawn.standin(model_dir), spawn.standin(model_dir)
    router = pd_router(spawn, prefill, decode, model=model_dir)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=10).status_code == 200
    echo = {**BODY, "echo": True}  # the pod must see the prompt's own text to echo it
    assert httpx.post(router.url + "/v1/completions", json=echo, timeout=10).status_code == 200
    for pod in (prefill, decode):
        assert requests(spawn, pod) == 3
        assert spawn.metric(pod.url, "standin:pretokenized_total") == 2


def test_a_clients_processed_prompt_never_reaches_a_pod(spawn, model_dir):
    """Pods take a processed prompt as is (image identifiers included), so only the router
    may set one: a client's is dropped, in P/D pools and colocated ones alike."""
    prefill, decode, plain = (spawn.standin(model_dir) for _ in range(3))
    forged = {**BODY, "processed_prompt": {"prompt_token_ids": [7] * 40}}
    for router in (pd_router(spawn, prefill, decode), spawn.router([plain])):
        r = httpx.post(router.url + "/v1/completions", json=forged, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] != 40
    for pod in (prefill, decode, plain):
        assert requests(spawn, pod) == 1
        assert spawn.metric(pod.url, "standin:pretokenized_total") == 0
