"""``epdserve serve MODEL -tp 2`` as a vLLM user starts it: a worker process per rank behind
the same API, and a rank killed mid-stream ends the stream with an error at once, /health
turns 503 (the pod restarts) and no process of the engine is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
from serving_support import ServerProcess


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def worker_pids(srv: ServerProcess) -> list[int]:
    core = srv.core_pid()
    return [p for p in children(core) if b"worker_proc" in open(f"/proc/{p}/cmdline", "rb").read()]


@pytest.fixture
def tp_server(models):
    srv = ServerProcess(str(models.get("llama")), "-tp", "2", api_key=None)
    yield srv
    srv.stop()


def test_tp2_serves_the_openai_client_and_a_killed_rank_fails_fast(tp_server):
    srv = tp_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    workers = worker_pids(srv)
    assert len(workers) == 2
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8
    stream = client.completions.create(
        model="tiny", prompt="x", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    received = 0
    with pytest.raises(openai.APIError):
        for _chunk in stream:
            received += 1
            if received == 5:
                killed = time.monotonic()
                os.kill(workers[1], signal.SIGKILL)
    assert received < 400 and time.monotonic() - killed < 5
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and httpx.get(srv.url + "/health").status_code != 503:
        time.sleep(0.1)
    assert httpx.get(srv.url + "/health").status_code == 503
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in workers), "a rank outlived its core"


def test_a_rank_that_dies_while_idle_turns_health_503_within_a_second(tp_server):
    srv = tp_server
    assert httpx.get(srv.url + "/health").status_code == 200
    os.kill(worker_pids(srv)[1], signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < 5 and httpx.get(srv.url + "/health").status_code != 503:
        time.sleep(0.05)
    assert httpx.get(srv.url + "/health").status_code == 503
    assert time.monotonic() - killed < 2
