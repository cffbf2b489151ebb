"""Admission on one pod: past --max-num-seqs running plus --max-queued-requests waiting
sequences a request gets 503 with Retry-After (OpenAI's shape, counted); the API key is
checked before a body byte is read; --limit-concurrency holds."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest
from serving_support import API_KEY, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def pod(models):
    srv = ServerProcess(
        str(models.get("llama")),
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "2",
        "--limit-concurrency",
        "32",
    )
    yield srv
    srv.stop()


def wait_admitted(pod, sequences: int) -> None:
    deadline = time.monotonic() + 60
    while pod.metric("epdserve:admitted_sequences") != sequences:
        assert time.monotonic() < deadline, pod.metric("epdserve:admitted_sequences")
        time.sleep(0.02)


@contextlib.contextmanager
def streams_holding(pod, count: int, n: int):
    """``count`` long streams of ``n`` sequences each, in flight until the block ends."""
    stop = threading.Event()

    def hold():
        body = {**BODY, "max_tokens": 400, "ignore_eos": True, "n": n, "stream": True}
        body["temperature"] = 1
        with httpx.stream(
            "POST", pod.url + "/v1/completions", json=body, headers=AUTH, timeout=120
        ) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # leaving closes the connection: the pod aborts the request

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def test_past_the_bound_a_request_gets_503_with_retry_after_and_later_is_served(pod):
    refused_before = pod.metric("epdserve:requests_refused_total")
    with streams_holding(pod, 2, n=2):
        wait_admitted(pod, 4)  # 2 running + 2 queued: full
        r = httpx.post(pod.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert "busy" in error["message"]
    assert pod.metric("epdserve:requests_refused_total") == refused_before + 1
    wait_admitted(pod, 0)
    r = httpx.post(pod.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


def test_a_request_larger_than_the_bound_is_served_by_an_idle_pod(pod):
    wait_admitted(pod, 0)
    r = httpx.post(
        pod.url + "/v1/completions",
        json={**BODY, "n": 6, "temperature": 1, "seed": 1},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 6
    wait_admitted(pod, 0)


def raw_request(pod, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` (and ``body``), then read until the pod closes the connection."""
    with socket.create_connection(("127.0.0.1", pod.port), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize(
    "framing", [b"Content-Length: 30000000\r\n", b"Transfer-Encoding: chunked\r\n"]
)
def test_a_wrong_key_gets_401_before_any_body_byte_is_sent(pod, framing):
    """Headers promise a big body and none follows: the 401 comes back anyway, and the
    pod closes the connection rather than read the body."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: pod\r\nAuthorization: Bearer wrong\r\n"
        b"Content-Type: application/json\r\n" + framing + b"\r\n"
    )
    answer = raw_request(pod, head)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b'"AuthenticationError"' in answer


def test_beyond_limit_concurrency_the_answer_is_503_with_retry_after(pod):
    """In the API's error shape with Retry-After, so a router takes the pod as busy."""
    idle = [socket.create_connection(("127.0.0.1", pod.port), timeout=30) for _ in range(32)]
    try:
        r = httpx.get(pod.url + "/v1/models", headers=AUTH, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == 503 and "concurrency" in r.json()["error"]["message"]
        # the kubelet's probes still pass: a saturated pod is busy, not dead (no restart)
        assert httpx.get(pod.url + "/health", timeout=30).status_code == 200
        assert httpx.get(pod.url + "/ready", timeout=30).status_code == 200
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 30
    while httpx.get(pod.url + "/v1/models", headers=AUTH, timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the pod never took requests again"
        time.sleep(0.05)
