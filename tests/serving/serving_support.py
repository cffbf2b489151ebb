"""Starts and stops a real ``epdserve serve`` subprocess for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from epdserve.common import metrics_text

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll ``url``/ready until 200; fail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


class ServerProcess:
    def __init__(
        self, model: str, *extra: str, api_key: str | None = API_KEY, env: dict | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-c",
            "import sys; from epdserve.engine.cli import main; sys.exit(main(sys.argv[1:]))",
            "serve",
            model,
            "--port",
            str(self.port),
            "--served-model-name",
            "tiny",
            "--kv-cache-memory",
            str(64 << 20),
            "--max-model-len",
            "512",
            *extra,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.api_key = api_key
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        wait_ready(self.url, self.proc, timeout)

    def core_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return int(out.stdout.split()[0])

    def metric(self, name: str) -> float:
        body = httpx.get(self.url + "/metrics", timeout=5).text
        found = metrics_text.values(body, name)
        assert found, f"metric {name} not exported"
        return sum(found)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
