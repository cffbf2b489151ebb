"""``epdserve up``: a local pool (engines + router) that answers and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from serving_support import free_port

from epdserve.common import metrics_text


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children start their own sessions, so walk ppids)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def wait_for_index(port: int, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    blocks = 0.0
    while time.monotonic() < deadline and blocks == 0:
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        blocks = metrics_text.total(body, "epdserve_router:index_blocks")  # all tiers
        time.sleep(0.2)
    return blocks


def test_up_serves_through_the_router_and_ctrl_c_stops_everything(models, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epdserve.engine.cli",
            "up",
            "--model",
            str(models.get("llama")),
            "--port",
            str(port),
            "--mode",
            "colocated",
            "--replicas",
            "2",
            "--kv-cache-memory",
            str(32 << 20),
            "--workdir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "ready: OpenAI API" in line or proc.poll() is not None:
                break
        assert any("ready: OpenAI API" in x for x in lines), "".join(lines)
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": "def main():", "max_tokens": 5, "temperature": 0},
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
        httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": "x = 1\n" * 40, "max_tokens": 2},
        )
        assert wait_for_index(port) > 0, "the router saw no KV events from the engines"
        pids = descendants(proc.pid)
        assert len(pids) >= 5  # 2 servers + their 2 engine cores + the router
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)  # stopping by now; `make run` passes a SIGTERM on: must not cut it
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert "stopped" in out and proc.returncode == 0
        assert "Traceback" not in out
        time.sleep(0.5)
        alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
        assert not alive, f"processes left behind: {alive}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_up_refuses_an_epd_pool_of_a_text_only_model_at_once(models):
    cmd = [sys.executable, "-m", "epdserve.engine.cli", "up", "--mode", "epd"]
    cmd += ["--model", str(models.get("llama")), "--port", str(free_port())]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "needs an image+text model" in result.stderr
