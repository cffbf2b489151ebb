"""Shared fixtures: tiny checkpoints built once per session, a real redis-server."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's prompts are tens of tokens long: it runs engines with 16-token KV blocks so that
# prefix caching, preemption and block accounting show at those lengths. The cpu default
# (128, measured) is tested by itself: tests/serving/test_default_block_size.py.
os.environ.setdefault("EPDSERVE_BLOCK_SIZE", "16")

import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

import epdserve.engine.config as _engine_config  # noqa: E402

_engine_config.CPU_BLOCK_SIZE = 16  # in-process engines (LLM), as the variable above


class ModelStore:
    """Builds ``make-model`` checkpoints on first use and reuses them for the session."""

    def __init__(self, root):
        self.root = root
        self.built = {}

    def get(self, arch: str, seed: int = 0, preset: str = "tiny"):
        from epdserve.engine.make_model import make_model

        key = (arch, seed, preset)
        if key not in self.built:
            self.built[key] = make_model(arch, self.root / f"{arch}-{preset}-s{seed}", seed, preset)
        return self.built[key]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> ModelStore:
    return ModelStore(tmp_path_factory.mktemp("models"))


class RedisServer:
    """A real ``redis-server`` process on a free loopback port (no persistence)."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.port = _free_port()
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import subprocess
        import time

        from epdserve.engine.entrypoints.up_cli import redis_command

        self.proc = subprocess.Popen(
            redis_command(find_redis_server(), self.port, self.workdir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import socket

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    """Debian's redis-server, else the one the ``redis-server`` pip package ships."""
    import shutil
    import sys
    from pathlib import Path

    found = shutil.which("redis-server") or str(Path(sys.executable).parent / "redis-server")
    if Path(found).exists():
        return found
    try:
        import redis_server  # pip package

        return redis_server.REDIS_SERVER_PATH
    except ImportError:
        pytest.fail("redis-server not found: run `make test` (it installs one)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A session-wide real redis-server; tests that kill it must restart it."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of a running, empty redis-server database."""
    import redis

    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


def make_read_only(path: str):
    """Make ``path`` read-only even for root; returns an undo function, or skips."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        for d in os.listdir(path):
            os.chmod(os.path.join(path, d), 0o555)
        return lambda: (
            [os.chmod(os.path.join(r, d), 0o755) for r, ds, _ in os.walk(path) for d in ds]
            + [os.chmod(path, 0o755)]
        )
    if shutil.which("mount"):
        bind = subprocess.run(["mount", "--bind", path, path], capture_output=True)
        if bind.returncode == 0:
            ro = subprocess.run(["mount", "-o", "remount,bind,ro", path], capture_output=True)
            if ro.returncode == 0:
                return lambda: subprocess.run(["umount", path], check=True)
            subprocess.run(["umount", path], check=True)
    if shutil.which("chattr"):
        dirs = [path] + [os.path.join(path, d) for d in os.listdir(path)]
        if subprocess.run(["chattr", "+i", *dirs], capture_output=True).returncode == 0:
            return lambda: subprocess.run(["chattr", "-i", *dirs], check=True)
    pytest.skip("running as root without a working read-only bind mount or chattr +i")


@pytest.fixture
def read_only():
    """``read_only(path) -> undo``: a directory read-only even for root (or the test skips)."""
    return make_read_only
