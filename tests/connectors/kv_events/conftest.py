"""KV-event socket fixtures: Curve key directories laid out as the operator mounts them."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq


@dataclass
class CurveDirs:
    """An engine's key directory, a router's, and a router's with a key nobody listed."""

    engine: Path
    router: Path
    stranger: Path
    server_public: bytes
    client_public: bytes


def write_keys(directory: Path, **keys: bytes) -> Path:
    """One file per key, raw Z85 bytes and no newline (a mounted Secret's items)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in keys.items():
        (directory / name.replace("_", ".")).write_bytes(value)
    return directory


@pytest.fixture
def curve_dirs(tmp_path) -> CurveDirs:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    other_public, other_secret = zmq.curve_keypair()
    engine = write_keys(
        tmp_path / "engine",
        server_public=server_public,
        server_secret=server_secret,
        client_public=client_public,
    )
    router = write_keys(
        tmp_path / "router",
        client_public=client_public,
        client_secret=client_secret,
        server_public=server_public,
    )
    stranger = write_keys(
        tmp_path / "stranger",
        client_public=other_public,
        client_secret=other_secret,
        server_public=server_public,
    )
    return CurveDirs(engine, router, stranger, server_public, client_public)


@pytest.fixture
def free_port():
    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick


@pytest.fixture
def wait_for():
    def wait(cond, timeout: float = 10.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not met within {timeout}s")
            time.sleep(0.01)

    return wait


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
