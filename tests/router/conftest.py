"""Router test fixtures: STAND-IN engine pods and the real ``epdserve router`` process.

(Helpers live here because tests run with ``--import-mode=importlib``.)"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from epdserve.common import metrics_text

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while choosing: one at a time, the kernel
    may hand the same port out twice, and a pod's HTTP and event sockets then collide)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=0.5).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up within {timeout}s")


@dataclass
class Proc:
    proc: subprocess.Popen
    url: str
    extra: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def start_standin(model_dir, log_dir: Path, **options) -> Proc:
    """A STAND-IN engine pod (tests/router/standin_pod.py) on free ports."""
    port, events, replay = free_ports(3)
    args = [sys.executable, str(HERE / "standin_pod.py"), "--port", str(port)]
    args += ["--events-port", str(events), "--replay-port", str(replay), "--model", str(model_dir)]
    for key, value in options.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    log = open(log_dir / f"standin-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    pod = Proc(proc, f"http://127.0.0.1:{port}", {"events": events, "replay": replay})
    try:
        wait_http(pod.url + "/health", proc)
    except BaseException:
        pod.kill()
        raise
    return pod


def start_serve(model_dir, log_dir: Path, *flags: str) -> Proc:
    """A real ``epdserve serve`` pod with KV events on free ports; waits for /ready."""
    import json

    port, events, replay = free_ports(3)
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": f"kv@127.0.0.1:{port}@tiny",
    }
    args = [
        sys.executable,
        "-m",
        "epdserve.engine.cli",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
    ]
    args += [
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--kv-events-config",
        json.dumps(config),
    ]
    log = open(log_dir / f"serve-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([*args, *flags], stdout=log, stderr=subprocess.STDOUT)
    return Proc(proc, f"http://127.0.0.1:{port}", {"events": events, "replay": replay})


def wait_ready(pod: Proc, timeout: float = 120.0) -> None:
    """Wait for a pod's /ready (200), failing fast if the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pod.proc.poll() is not None:
            raise RuntimeError(f"pod {pod.url} exited with {pod.proc.returncode}")
        try:
            if httpx.get(pod.url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"pod {pod.url} not ready within {timeout}s")


def endpoint_flag(pod: Proc) -> str:
    return f"{pod.url},events={pod.extra['events']},replay={pod.extra['replay']}"


def start_router(pods: list[Proc], log_dir: Path, *flags: str) -> Proc:
    """The real ``epdserve router`` CLI in a subprocess."""
    port = free_port()
    args = [sys.executable, "-m", "epdserve.engine.cli", "router", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--scrape-interval", "0.2", "--log-level", "warning", *flags]
    for pod in pods:
        args += ["--endpoint", endpoint_flag(pod)]
    log = open(log_dir / f"router-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    router = Proc(proc, f"http://127.0.0.1:{port}")
    try:
        wait_http(router.url + "/health", proc)
    except BaseException:
        router.kill()
        raise
    return router


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a metric's samples (matching ``labels``) in a /metrics page."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return metrics_text.total(text, name, **(labels or {}))


class Spawner:
    """Starts processes for a test and stops every one of them afterwards."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def standin(self, model_dir, **options) -> Proc:
        pod = start_standin(model_dir, self.log_dir, **options)
        self.procs.append(pod)
        return pod

    def serve(self, model_dir, *flags: str) -> Proc:
        """A real engine pod (not waited for: start several, then ``wait_ready`` each)."""
        pod = start_serve(model_dir, self.log_dir, *flags)
        self.procs.append(pod)
        return pod

    wait_ready = staticmethod(wait_ready)

    def router(self, pods: list[Proc], *flags: str) -> Proc:
        router = start_router(pods, self.log_dir, *flags)
        self.procs.append(router)
        return router

    metric = staticmethod(metric)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def spawn(tmp_path):
    spawner = Spawner(tmp_path)
    yield spawner
    spawner.close()


@pytest.fixture(scope="module")
def module_spawn(tmp_path_factory):
    spawner = Spawner(tmp_path_factory.mktemp("procs"))
    yield spawner
    spawner.close()


@pytest.fixture
def lora_pods():
    """Makes stand-in LoRA pods (tests/router/lora_pods.py), closed after the test."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from lora_pods import LoraPod

    made = []

    def make(*args, **kwargs):
        made.append(LoraPod(*args, **kwargs))
        return made[-1]

    yield make
    for pod in made:
        pod.close()
