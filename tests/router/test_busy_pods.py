"""A busy pod (503 with Retry-After: its admission bound is reached) is skipped for another
pod without counting as a failure; when every pod is busy the client gets 503 with
Retry-After in OpenAI's shape, also on the prefill and decode legs of a P/D pool.
STAND-IN pods (``standin_pod.py``) answer ``--fail-status`` with ``--retry-after``."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}


@pytest.fixture(scope="module")
def model_dir(models):
    return models.get("llama")


def wait_ready(url: str, pods: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(url + "/ready", timeout=2)
        if r.status_code == 200 and r.json()["pods"] == pods:
            return
        time.sleep(0.05)
    raise AssertionError("router never became ready")


def requests(spawn, pod) -> float:
    return spawn.metric(pod.url, "standin:requests_total")


def assert_busy_answer(r: httpx.Response, retry_after: str) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == retry_after
    error = r.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "busy" in error["message"]


def test_a_busy_pod_is_skipped_and_rests_for_its_retry_after(spawn, model_dir):
    busy = spawn.standin(model_dir, fail_status=503, retry_after="30")
    good = spawn.standin(model_dir)
    router = spawn.router([busy, good], "--strategy", "round-robin", "--scrape-interval", "60")
    wait_ready(router.url, 2)
    for _ in range(6):
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200 and r.json()["pod"] == int(good.url.rsplit(":", 1)[1])
    assert requests(spawn, busy) == 1  # then out of rotation for its 30 s
    assert (
        spawn.metric(router.url, "epdserve_router:upstream_retries_total", {"cause": "busy"}) == 1
    )
    failures = {"cause": "http_503"}
    assert spawn.metric(router.url, "epdserve_router:upstream_retries_total", failures) == 0


def test_busy_pods_do_not_use_up_the_attempts(spawn, model_dir):
    pods = [spawn.standin(model_dir, fail_status=503, retry_after="5") for _ in range(3)]
    pods.append(spawn.standin(model_dir))
    router = spawn.router(pods, "--strategy", "round-robin", "--max-attempts", "1")
    wait_ready(router.url, 4)
    for _ in range(4):  # whichever pod round-robin ranks first
        assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code == 200


def test_with_every_pod_busy_the_client_gets_503_with_the_shortest_retry_after(spawn, model_dir):
    pods = [
        spawn.standin(model_dir, fail_status=503, retry_after=seconds) for seconds in ("7", "3")
    ]
    router = spawn.router(pods, "--scrape-interval", "60")
    wait_ready(router.url, 2)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert_busy_answer(r, "3")
    assert sum(requests(spawn, p) for p in pods) == 2
    failures = spawn.metric(
        router.url, "epdserve_router:request_failures_total", {"reason": "all_busy"}
    )
    assert failures == 1


def test_a_real_pod_at_its_concurrency_limit_is_busy_not_failed(spawn, model_dir):
    """Past --limit-concurrency a pod answers 503 with Retry-After, like its admission bound:
    the router rests it instead of counting a failure (uvicorn's plain 503 was one)."""
    pod = spawn.serve(model_dir, "--limit-concurrency", "4", "--header-read-timeout", "600")
    spawn.wait_ready(pod)
    router = spawn.router([pod])
    wait_ready(router.url, 1)
    port = int(pod.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
    try:
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
    finally:
        for s in idle:
            s.close()
    assert_busy_answer(r, "1")
    errors = "epdserve_router:upstream_errors_total"
    assert spawn.metric(router.url, errors, {"kind": "busy"}) >= 1
    assert spawn.metric(router.url, errors, {"kind": "http_503"}) == 0
    failures = {"reason": "all_busy"}
    assert spawn.metric(router.url, "epdserve_router:request_failures_total", failures) == 1


def test_a_pod_holding_max_pod_connections_requests_is_busy(spawn, model_dir):
    pod = spawn.standin(model_dir, hang_s=30)
    router = spawn.router([pod], "--max-pod-connections", "1")
    wait_ready(router.url, 1)

    def hang() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut when the test tears the router down
            httpx.post(router.url + "/v1/completions", json=BODY, timeout=60)

    hanging = threading.Thread(target=hang, daemon=True)
    hanging.start()
    deadline = time.monotonic() + 20
    while spawn.metric(router.url, "epdserve_router:inflight_requests") < 1:
        assert time.monotonic() < deadline, "the first request never reached the pod"
        time.sleep(0.05)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert_busy_answer(r, "1")
    assert requests(spawn, pod) == 1


def pd_router(spawn, prefill, decode):
    def flag(pod) -> str:
        return f"{pod.url},events={pod.extra['events']},replay={pod.extra['replay']}"

    flags = ["--prefill-endpoint", flag(prefill), "--decode-endpoint", flag(decode)]
    router = spawn.router([], *flags)
    wait_ready(router.url, 2)
    return router


def test_every_prefill_pod_busy_answers_503_and_leaves_decode_alone(spawn, model_dir):
    prefill = spawn.standin(model_dir, fail_status=503, retry_after="2")
    decode = spawn.standin(model_dir)
    router = pd_router(spawn, prefill, decode)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert_busy_answer(r, "2")
    assert requests(spawn, prefill) == 1 and requests(spawn, decode) == 0


def test_every_decode_pod_busy_answers_503_with_retry_after(spawn, model_dir):
    prefill = spawn.standin(model_dir)
    decode = spawn.standin(model_dir, fail_status=503, retry_after="4")
    router = pd_router(spawn, prefill, decode)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert_busy_answer(r, "4")
    assert requests(spawn, decode) == 1
