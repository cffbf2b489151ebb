"""kill -9 a real ``epdserve serve`` pod (its whole process group: API and engine core) and
restart it on the same ports: soon after its return (the checks run every 2 s; 30 s allows a
loaded machine) the real router's index holds none
of the old process's blocks, and the old prefix is no longer routed to it as a prefix hit.

The router scrapes pods only once here (``--scrape-interval 600``), so its health check
never sees the pod down: the index heals by the KV-event checks alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from epdserve.common import metrics_text

HEAL_WITHIN = 30.0  # a deadline, not a figure: 10 s ran out once under a loaded make test
PROMPT = [(7 * i) % 3000 + 10 for i in range(130)]  # 8 full blocks of 16


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Pod:
    """One ``epdserve serve`` process group on fixed ports, restartable."""

    def __init__(self, model_dir, log_dir, ports: list[int]):
        self.model_dir, self.log_dir = model_dir, log_dir
        self.port, self.events, self.replay = ports
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = {"events": self.events, "replay": self.replay}
        self.name = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
            "topic": f"kv@127.0.0.1:{self.port}@tiny",
        }
        args = [sys.executable, "-m", "epdserve.engine.cli", "serve", str(self.model_dir)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "tiny"]
        args += ["--max-model-len", "256", "--kv-events-config", json.dumps(config)]
        self.starts += 1
        log = open(self.log_dir / f"pod-{self.port}-{self.starts}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"pod {self.url} exited with {self.proc.returncode}"
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"pod {self.url} not ready within {timeout}s")

    def kill_group(self) -> None:
        """SIGKILL to every process of the pod (API and engine core alike)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def pods(models, tmp_path):
    model_dir = models.get("llama")
    ports = free_ports(6)
    made = [Pod(model_dir, tmp_path, ports[i : i + 3]) for i in (0, 3)]
    try:
        for pod in made:
            pod.start()
        for pod in made:
            pod.wait_ready()
        yield made
    finally:
        for pod in made:
            pod.kill_group()


def router_metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return metrics_text.total(text, "epdserve_router:" + name, **labels)


def complete(url: str) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_pod_killed_and_restarted_loses_its_index_entries_and_its_prefix_hits(
    pods, spawn, models
):
    flags = ("--model", str(models.get("llama")), "--strategy", "prefix")
    flags += ("--speculative-ttl", "0", "--scrape-interval", "600", "--log-level", "info")
    router = spawn.router([SimpleNamespace(url=p.url, extra=p.extra) for p in pods], *flags)
    url = router.url
    wait_until(
        lambda: httpx.get(url + "/ready", timeout=2).status_code == 200, 20, "router not ready"
    )

    def blocks(pod: Pod) -> float:
        return router_metric(url, "index_pod_blocks", pod=pod.name, tier="local")

    def prefix_hits(pod: Pod) -> float:
        return router_metric(url, "requests_total", pod=pod.name, reason="prefix_hit")

    complete(url)
    victim = next(p for p in pods if router_metric(url, "requests_total", pod=p.name) == 1)
    wait_until(lambda: blocks(victim) >= 8, 10, "the prompt's blocks were never indexed")
    complete(url)  # the same prompt again: a prefix hit on the pod holding it
    assert prefix_hits(victim) == 1

    victim.kill_group()
    victim.start()  # same ports, a new process: empty cache, events from seq 0
    victim.wait_ready()
    wait_until(lambda: blocks(victim) == 0, HEAL_WITHIN, "stale entries outlived the restart")
    assert router_metric(url, "index_resyncs_total", pod=victim.name, reason="restart") >= 1

    complete(url)
    assert prefix_hits(victim) == 1  # not routed there for a prefix it no longer holds
    assert router_metric(url, "requests_total", reason="prefix_hit") == 1
