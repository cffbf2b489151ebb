"""Graceful scale-down: SIGTERM drains a pod; streams in flight finish, new work is refused."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from serving_support import ServerProcess

STREAMS = 3
MAX_TOKENS = 3000  # seconds of decoding even on a fast machine: SIGTERM lands mid-stream


@pytest.fixture
def pod(models):
    srv = ServerProcess(
        str(models.get("qwen2")), "--max-model-len", "4096", "--drain-timeout", "120", api_key=None
    )
    yield srv
    srv.stop()


def _stream(url: str, started: threading.Event, signalled: threading.Event, out: dict) -> None:
    """One long stream; records its usage, finish reason and chunks seen after SIGTERM."""
    body = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out["after_signal"] = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as resp:
        out["status"] = resp.status_code
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            started.set()
            chunk = json.loads(line[len("data: ") :])
            out["after_signal"] += signalled.is_set()
            for choice in chunk.get("choices") or []:
                out["finish_reason"] = choice.get("finish_reason") or out.get("finish_reason")
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]


def _refused(url: str) -> bool:
    """A new request is turned away: 503 while the port is open, refused once it closes."""
    try:
        resp = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 1},
            timeout=30,
        )
    except httpx.ConnectError:
        return True
    return resp.status_code == 503


@pytest.mark.parametrize(
    "send",
    [
        # as the kubelet does: SIGTERM to the server process only
        pytest.param(lambda pid: os.kill(pid, signal.SIGTERM), id="sigterm-to-the-process"),
        # as a terminal's Ctrl-C does: SIGINT to the whole process group; the engine core
        # runs in its own session, so it keeps serving until the drain is over
        pytest.param(
            lambda pid: os.killpg(pid, signal.SIGINT),
            id="sigint-to-the-group",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_an_exit_signal_lets_inflight_streams_finish_refuses_new_work_and_exits_cleanly(pod, send):
    signalled = threading.Event()
    results = [{} for _ in range(STREAMS)]
    started = [threading.Event() for _ in range(STREAMS)]
    threads = [
        threading.Thread(target=_stream, args=(pod.url, started[i], signalled, results[i]))
        for i in range(STREAMS)
    ]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60), "a stream never started"

    core_args = Path(f"/proc/{pod.core_pid()}/cmdline").read_bytes().split(b"\0")
    sockets = os.path.dirname(core_args[core_args.index(b"--input") + 1][len(b"ipc://") :])
    assert os.path.isdir(sockets)
    send(pod.proc.pid)
    signalled.set()
    assert _refused(pod.url)

    for thread in threads:
        thread.join(180)
    assert pod.proc.wait(60) == 0
    assert not os.path.exists(sockets)  # the core's socket folder goes with it
    for out in results:
        assert out["status"] == 200
        assert out["after_signal"] > 0, "the stream had ended before SIGTERM: nothing drained"
        assert out["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
