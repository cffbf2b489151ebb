"""If the engine-core process dies, /health turns 503 and requests fail fast."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from serving_support import ServerProcess


@pytest.fixture
def doomed_server(models):
    srv = ServerProcess(str(models.get("qwen2")), "--max-model-len", "4096", api_key=None)
    yield srv
    srv.stop()


def test_killing_the_core_fails_pending_and_new_requests_within_seconds(doomed_server):
    srv = doomed_server
    results = {}

    def long_request():
        start = time.monotonic()
        try:
            resp = httpx.post(
                srv.url + "/v1/completions",
                timeout=60,
                json={"model": "tiny", "prompt": "x", "max_tokens": 4000, "ignore_eos": True},
            )
            results["status"] = resp.status_code
        except httpx.HTTPError as exc:
            results["status"] = repr(exc)
        results["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=long_request)
    thread.start()
    # Kill as soon as the core is decoding it: 4000 tokens leave seconds of work even on a
    # fast machine, so the request is still pending when the core dies.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and srv.metric("vllm:num_requests_running") < 1:
        time.sleep(0.02)
    assert "status" not in results, "the request finished before the core could be killed"
    os.kill(srv.core_pid(), signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
    # in flight: 500 (it may be what ended the core, so no router retries it); new: 503
    assert results["status"] == 500 and results["elapsed"] < 15
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and httpx.get(srv.url + "/health").status_code != 503:
        time.sleep(0.1)
    assert httpx.get(srv.url + "/health").status_code == 503
    resp = httpx.post(
        srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10
    )
    assert resp.status_code == 503 and "engine" in resp.json()["error"]["message"]
