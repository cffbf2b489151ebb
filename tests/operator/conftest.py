"""Fixtures for the operator tests: the API emulator in a thread, clients, the operator."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # k8s_emulator / k8s_server / k8s_patch

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def api(tmp_path, monkeypatch):
    """A running API emulator; KUBECONFIG points at it for the test's duration."""
    from k8s_server import EmulatorThread

    with EmulatorThread(tmp_path) as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
        yield server
