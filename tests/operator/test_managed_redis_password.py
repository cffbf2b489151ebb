"""The managed Redis container's command and readiness probe, run for real (`sh -c` and a
real redis-server): the password from the env protects the server, even one with quotes and
backslashes, and never appears in any process's argv."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ipool_samples import pool_body

from epdserve.operator import cache
from epdserve.operator.spec import parse_pool

PASSWORD = 'p@ss w"rd $x\\y'  # a hand-made Secret may hold anything; ours are url-safe


def find_redis_server() -> str:
    found = shutil.which("redis-server") or str(Path(sys.executable).parent / "redis-server")
    if not Path(found).exists():
        pytest.fail("redis-server not found: run `make test` (it installs one)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def container(tmp_path: Path, port: int) -> dict:
    pool = parse_pool(pool_body(roles={"prefill": {}, "decode": {}}, cache={
        "backend": "redis", "redis": {"managed": True}}))  # fmt: skip
    spec = cache.build_redis_deployment(pool)["spec"]["template"]["spec"]["containers"][0]
    args = spec["args"][0].replace("--port 6379", f"--port {port}")
    spec["args"] = [args.replace("--dir /data", f"--dir {tmp_path}")]
    return spec


def reply(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(command)
        return s.recv(64)


def recording_wrappers(bin_dir: Path, real_dir: Path, log: Path) -> None:
    """`redis-server` and `redis-cli` on PATH that write their argv to `log`, then exec the
    real ones: what `ps` on the node would show."""
    bin_dir.mkdir()
    for name in ("redis-server", "redis-cli"):
        wrapper = bin_dir / name
        wrapper.write_text(
            f'#!/bin/sh\nprintf "%s\\n" "$0" "$@" >> {log}\nexec {real_dir / name} "$@"\n'
        )
        wrapper.chmod(0o755)


@pytest.fixture
def managed_redis(tmp_path):
    binary = find_redis_server()
    port = free_port()
    spec = container(tmp_path, port)
    recording_wrappers(tmp_path / "bin", Path(binary).parent, tmp_path / "argv.log")
    path = f"{tmp_path / 'bin'}:{Path(binary).parent}:{os.environ.get('PATH', '')}"
    env = {"PATH": path, "REDIS_PASSWORD": PASSWORD}
    proc = subprocess.Popen(
        [*spec["command"], *spec["args"]],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the shell pipes into redis-server: stop the whole group
    )
    deadline = time.monotonic() + 10
    while proc.poll() is None:
        try:
            reply(port, b"PING\r\n")
            break
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    assert proc.poll() is None, "redis-server exited"
    yield proc, port, spec, env
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)


def test_the_server_requires_the_password_from_the_env(managed_redis):
    _, port, _, _ = managed_redis
    assert reply(port, b"PING\r\n").startswith(b"-NOAUTH")
    quoted = PASSWORD.replace("\\", "\\\\").replace('"', '\\"')
    assert reply(port, f'AUTH "{quoted}"\r\nPING\r\n'.encode()).startswith(b"+OK")


def test_no_process_argv_carries_the_password(managed_redis, tmp_path):
    argv = (tmp_path / "argv.log").read_text()
    assert "redis-server" in argv and "--maxmemory" in argv  # the wrapper saw the real start
    assert PASSWORD not in argv


def test_the_readiness_probe_passes_with_the_password_from_the_env(managed_redis, tmp_path):
    _, port, spec, env = managed_redis
    if not (Path(find_redis_server()).parent / "redis-cli").exists():
        pytest.skip("no redis-cli next to redis-server")
    probe = spec["readinessProbe"]["exec"]["command"]
    assert PASSWORD not in " ".join(probe)
    probe = [*probe[:2], probe[2].replace("redis-cli", f"redis-cli -p {port}")]
    done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=10)
    assert done.stdout.strip() == "PONG", done.stdout + done.stderr
    argv = (tmp_path / "argv.log").read_text()
    assert "redis-cli" in argv and PASSWORD not in argv
