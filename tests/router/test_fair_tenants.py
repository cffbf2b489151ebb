"""Fair tenants through the real router: tenant keys, the per-tenant fair queue in front of
saturated pods, its bounds, and its metrics.

The fairness test runs against a real ``epdserve serve`` pod (``--max-num-seqs 2``), stopped
(SIGSTOP) while the backlog builds, so the queue's order is set by the queue alone and not by
how fast the pod drains it; the bounds tests hold slots with a STAND-IN pod's slow streams, so
a request provably waits. Assertions are on admission order (the ``x-epdserve-admission``
header) and counts."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

HEAVY, LIGHT = "sk-heavy", "sk-light"
TENANTS = {
    "tenants": [
        {"name": "heavy", "weight": 1, "keys": [HEAVY]},
        {"name": "light", "weight": 1, "keys": [LIGHT]},
    ]
}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    path.write_text(json.dumps(TENANTS))
    return str(path)


def wait_until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def wait_ready(url: str) -> None:
    wait_until(lambda: httpx.get(url + "/ready", timeout=2).status_code == 200, "router ready")


def complete(url: str, key: str, max_tokens: int = 24) -> tuple[int, int]:
    """One completion with the official client; (admission ordinal, completion tokens)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="the fair queue", max_tokens=max_tokens, temperature=0
    )
    return int(raw.headers["x-epdserve-admission"]), raw.parse().usage.completion_tokens


@pytest.fixture(scope="module")
def real_pod(module_spawn, models):
    pod = module_spawn.serve(models.get("llama"), "--max-num-seqs", "2")
    module_spawn.wait_ready(pod)
    return pod


@pytest.fixture(scope="module")
def real_router(module_spawn, real_pod, keys_file):
    # while the fairness test holds the pod stopped: no scrapes (timed-out ones would take
    # the pod out of rotation) and no queue timeouts, however slow the machine
    router = module_spawn.router(
        [real_pod],
        "--tenant-keys",
        keys_file,
        "--max-inflight-per-pod",
        "2",
        "--tenant-admission-header",
        "--scrape-interval",
        "600",
        "--tenant-queue-timeout",
        "600",
    )
    wait_ready(router.url)
    return router


@contextlib.contextmanager
def stopped(pod):
    """The pod's server stopped (SIGSTOP): requests sent to it wait, none finishes."""
    pod.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        pod.proc.send_signal(signal.SIGCONT)


def test_a_light_tenant_overtakes_a_heavy_tenants_backlog_on_a_real_pod(
    module_spawn, real_pod, real_router
):
    url, metric = real_router.url, module_spawn.metric

    def depth(tenant):
        return metric(url, "epdserve_router:tenant_queue_depth", {"tenant": tenant})

    def active():
        return metric(url, "epdserve_router:fair_queue_active")

    with ThreadPoolExecutor(44) as pool, stopped(real_pod):
        # two heavy requests hold the pod's slots and cannot finish: the rest wait
        heavy = [pool.submit(complete, url, HEAVY) for _ in range(40)]
        wait_until(lambda: depth("heavy") == 38 and active() == 2, "the heavy backlog", 300)
        light = [pool.submit(complete, url, LIGHT) for _ in range(4)]
        wait_until(lambda: depth("light") == 4, "the light requests queued", 300)
    heavy_done = [f.result() for f in heavy]
    light_done = [f.result() for f in light]
    # work-conserving: the heavy tenant's every request was served, in full
    assert [tokens for _, tokens in heavy_done] == [24] * 40
    assert [tokens for _, tokens in light_done] == [24] * 4
    admitted = sorted(
        [(seq, "heavy") for seq, _ in heavy_done] + [(seq, "light") for seq, _ in light_done]
    )
    assert len({seq for seq, _ in admitted}) == 44  # every admission has its own ordinal
    order = [tenant for _, tenant in admitted]
    # FIFO would admit the 38 waiting heavy requests first; fair queueing alternates the two
    # tenants once a slot frees, so the light tenant's four come within the next eight
    assert order[:2] == ["heavy", "heavy"] and order[2:10].count("light") == 4, order
    # the queue's metrics agree with what the clients saw
    assert metric(url, "epdserve_router:tenant_requests_admitted_total", {"tenant": "heavy"}) == 40
    assert metric(url, "epdserve_router:tenant_requests_admitted_total", {"tenant": "light"}) == 4
    assert metric(url, "epdserve_router:tenant_queue_seconds_count", {"tenant": "light"}) == 4
    assert depth("heavy") == 0 and depth("light") == 0
    wait_until(lambda: active() == 0, "every slot released")  # after each response's last byte


def test_an_unknown_key_is_an_openai_401_and_a_tenant_key_is_not(real_router):
    r = httpx.post(
        real_router.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 1},
        headers={"Authorization": "Bearer sk-nobody"},
        timeout=10,
    )
    assert r.status_code == 401
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert complete(real_router.url, LIGHT, max_tokens=1)[1] == 1


@pytest.fixture(scope="module")
def slow_router(module_spawn, models, keys_file):
    """One slot, two waiting requests per tenant, a 1 s wait; a stand-in whose streams take
    ~4 s hold the slot."""
    pod = module_spawn.standin(models.get("llama"), token_s=0.2)
    router = module_spawn.router(
        [pod],
        "--tenant-keys",
        keys_file,
        "--max-inflight-per-pod",
        "1",
        "--tenant-queue-size",
        "2",
        "--tenant-queue-timeout",
        "1",
    )
    wait_ready(router.url)
    return router


def hold_slot(url: str):
    """A streaming request that keeps the only slot ~4 s; returns the open response."""
    client = httpx.Client(base_url=url, timeout=30)
    body = {"model": "tiny", "prompt": "hold", "max_tokens": 20, "stream": True}
    request = client.build_request(
        "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {HEAVY}"}
    )
    response = client.send(request, stream=True)
    assert response.status_code == 200
    return client, response


def queued_socket(url: str, key: str) -> socket.socket:
    """A raw client whose request waits in the queue (so the test can drop it)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "q", "max_tokens": 1}).encode()
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def test_a_client_that_leaves_while_queued_leaves_the_queue(module_spawn, slow_router):
    url, metric = slow_router.url, module_spawn.metric
    depth = {"tenant": "light"}
    gone = {"tenant": "light", "reason": "disconnected"}
    before = metric(url, "epdserve_router:tenant_requests_rejected_total", gone)
    client, held = hold_slot(url)
    try:
        sock = queued_socket(url, LIGHT)
        wait_until(lambda: metric(url, "epdserve_router:tenant_queue_depth", depth) == 1, "queued")
        sock.close()
        wait_until(
            lambda: metric(url, "epdserve_router:tenant_requests_rejected_total", gone) > before,
            "the disconnect counted",
        )
        assert metric(url, "epdserve_router:tenant_queue_depth", depth) == 0
    finally:
        held.close()
        client.close()
    wait_until(lambda: metric(url, "epdserve_router:fair_queue_active") == 0, "slot freed")


def test_a_full_tenant_queue_is_a_429_and_a_long_wait_a_503_with_retry_after(
    module_spawn, slow_router
):
    url, metric = slow_router.url, module_spawn.metric
    client, held = hold_slot(url)
    socks = []
    try:
        socks = [queued_socket(url, LIGHT) for _ in range(2)]
        wait_until(
            lambda: metric(url, "epdserve_router:tenant_queue_depth", {"tenant": "light"}) == 2,
            "two light requests queued",
        )
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
        full = httpx.post(
            url + "/v1/completions",
            json=body,
            timeout=10,
            headers={"Authorization": f"Bearer {LIGHT}"},
        )
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "RateLimitError"
        # the other tenant still has room in its own queue, but the slot stays held: 503
        late = httpx.post(
            url + "/v1/completions",
            json=body,
            timeout=10,
            headers={"Authorization": f"Bearer {HEAVY}"},
        )
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        assert late.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        for sock in socks:
            sock.close()
        held.close()
        client.close()
    timeouts = {"tenant": "heavy", "reason": "queue_timeout"}
    assert metric(url, "epdserve_router:tenant_requests_rejected_total", timeouts) == 1
