"""Which upstream failures the real router retries on the next pod, and which it returns.

Only pod failures (connection refused, reset before the headers, 503) move a request on;
a 4xx or 500 is the pod's answer to *this* request and goes to the client unchanged, from
exactly one pod, without touching the pod's failure backoff. STAND-IN pods
(``standin_pod.py``) count the requests they receive in ``standin:requests_total``.
"""

from __future__ import annotations

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


def pod_requests(spawn, pods) -> float:
    return sum(spawn.metric(p.url, "standin:requests_total") for p in pods)


@pytest.mark.parametrize("status", [400, 500, 502])
def test_a_pod_error_answer_is_returned_as_is_from_exactly_one_pod(spawn, model_dir, status):
    pods = [spawn.standin(model_dir, fail_status=status) for _ in range(3)]
    router = spawn.router(pods)
    wait_ready(router.url, 3)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == status
    assert r.json() == {"error": "stand-in told to fail"}
    assert pod_requests(spawn, pods) == 1
    assert spawn.metric(router.url, "epdserve_router:upstream_retries_total") == 0


def test_a_streamed_request_gets_the_pods_error_status_unchanged(spawn, model_dir):
    pods = [spawn.standin(model_dir, fail_status=500) for _ in range(2)]
    router = spawn.router(pods)
    wait_ready(router.url, 2)
    with httpx.stream(
        "POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10
    ) as r:
        assert r.status_code == 500
        r.read()
    assert pod_requests(spawn, pods) == 1


def test_a_read_timeout_after_sending_is_not_retried(spawn, model_dir):
    pods = [spawn.standin(model_dir, hang_s=30) for _ in range(2)]
    router = spawn.router(pods, "--upstream-timeout", "0.5")
    wait_ready(router.url, 2)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == 504
    assert pod_requests(spawn, pods) == 1


def test_a_refused_connection_moves_the_request_to_the_next_pod(spawn, model_dir):
    pods = [spawn.standin(model_dir) for _ in range(2)]
    # no scrape during the test: the router must find the dead pod by sending to it
    router = spawn.router(pods, "--strategy", "round-robin", "--scrape-interval", "60")
    wait_ready(router.url, 2)
    pods[0].kill()
    for _ in range(4):
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["pod"] == int(pods[1].url.rsplit(":", 1)[1])
    retries = spawn.metric(router.url, "epdserve_router:upstream_retries_total")
    refused = spawn.metric(
        router.url, "epdserve_router:upstream_retries_total", {"cause": "connect_refused"}
    )
    closed = spawn.metric(
        router.url, "epdserve_router:upstream_retries_total", {"cause": "closed_before_headers"}
    )
    assert retries >= 1 and refused + closed == retries  # a pooled keep-alive may be closed


def test_a_pod_answering_503_moves_the_request_to_the_next_pod(spawn, model_dir):
    bad, good = spawn.standin(model_dir, fail_status=503), spawn.standin(model_dir)
    router = spawn.router([bad, good], "--strategy", "round-robin")
    wait_ready(router.url, 2)
    for _ in range(2):  # round-robin: one of the two ranks the 503 pod first
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200, r.text
    assert spawn.metric(bad.url, "standin:requests_total") == 1
    assert (
        spawn.metric(router.url, "epdserve_router:upstream_retries_total", {"cause": "http_503"})
        == 1
    )


def test_4xx_answers_leave_the_pod_in_rotation(spawn, model_dir):
    bad, good = spawn.standin(model_dir, fail_status=400), spawn.standin(model_dir)
    # a long backoff: had the 400 tripped the breaker, every later request would go to `good`
    router = spawn.router(
        [bad, good],
        "--strategy",
        "round-robin",
        "--failure-backoff",
        "600",
        "--scrape-interval",
        "60",
    )
    wait_ready(router.url, 2)
    statuses = [
        httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code
        for _ in range(6)
    ]
    assert sorted(statuses) == [200, 200, 200, 400, 400, 400]


def test_a_503_puts_the_pod_in_backoff(spawn, model_dir):
    bad, good = spawn.standin(model_dir, fail_status=503), spawn.standin(model_dir)
    router = spawn.router(
        [bad, good],
        "--strategy",
        "round-robin",
        "--failure-backoff",
        "600",
        "--scrape-interval",
        "60",
    )
    wait_ready(router.url, 2)
    for _ in range(6):
        assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert spawn.metric(bad.url, "standin:requests_total") == 1
