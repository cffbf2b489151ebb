"""A real Prometheus server (Debian's `prometheus` package) on a free loopback port."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from serving_support import free_port

INSTALL_HINT = "`make prometheus` installs Debian's prometheus package (needs root and apt-get)"


def find_binary(name: str) -> str:
    """`prometheus` or `promtool`; skips where it cannot be installed, fails where it could."""
    found = shutil.which(name)
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail(f"{name} not found: {INSTALL_HINT}")
    pytest.skip(f"{name} not installed and this machine cannot install it: {INSTALL_HINT}")


class PrometheusServer:
    """`prometheus` with a static scrape config, scraping every `interval_s` seconds."""

    def __init__(self, workdir: Path, static_configs: list[dict], rule_files=(), interval_s=1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        interval = f"{interval_s}s"
        self.interval_s = interval_s
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(f) for f in rule_files],
            "scrape_configs": [
                {"job_name": "epdserve", "static_configs": static_configs, "scrape_timeout": "1s"}
            ],
        }
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        promtool = find_binary("promtool")
        check = subprocess.run([promtool, "check", "config", str(path)], capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                find_binary("prometheus"),
                f"--config.file={path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus did not become ready")

    def api(self, path: str, **params) -> dict:
        resp = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = resp.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        data = self.api("query_range", query=expr, start=start, end=end, step=self.interval_s)
        return data["result"]

    def wait_for(self, expr: str, what: str, timeout: float = 30) -> None:
        """Poll until the instant query `expr` has a result (the condition holds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.query(expr):
                return
            time.sleep(self.interval_s / 4)
        raise AssertionError(f"Prometheus never saw {what} ({expr})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def finite_points(result: list[dict]) -> int:
    """Finite sample values in an instant or range query result (NaN is no data on a panel)."""
    values = [v for series in result for v in series.get("values", [series.get("value")]) if v]
    return sum(1 for _, value in values if math.isfinite(float(value)))
