"""Every hostile input gets a 4xx naming what is wrong, from a pod and through the router;
afterwards the pod's engine core is the same process and still serves."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from hostile_inputs import AUTH, TABLE, check, send
from serving_support import free_port, wait_ready


@pytest.fixture(scope="module")
def router(server, models, tmp_path_factory):
    """The real ``epdserve router`` in front of the module's pod."""
    port = free_port()
    endpoint = f"{server.url},events={free_port()},replay=none"
    cmd = [sys.executable, "-m", "epdserve.engine.cli", "router", "--port", str(port)]
    cmd += ["--endpoint", endpoint, "--model", str(models.get("llama"))]
    cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1"]
    log = open(tmp_path_factory.mktemp("router") / "router.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def still_serves(server, core_pid: int) -> None:
    assert server.core_pid() == core_pid, "the engine core was replaced"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x = 1", "max_tokens": 3, "temperature": 0},
        headers=AUTH,
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("target", ["pod", "router"])
def test_every_hostile_input_gets_a_4xx_and_the_core_survives(server, router, target):
    core_pid = server.core_pid()
    url = server.url if target == "pod" else router
    assert len(TABLE) >= 25
    for case in TABLE:
        check(send(url, case), case)
    still_serves(server, core_pid)


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
