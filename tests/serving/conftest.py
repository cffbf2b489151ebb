"""A real ``epdserve serve`` subprocess per module, driven over HTTP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serving_support import API_KEY, ServerProcess, free_port, wait_ready  # noqa: E402


@pytest.fixture(scope="module")
def server(models):
    srv = ServerProcess(str(models.get("llama")))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def router(server, models, tmp_path_factory):
    """The real ``epdserve router`` in front of the module's pod."""
    port = free_port()
    endpoint = f"{server.url},events={free_port()},replay=none"
    cmd = [sys.executable, "-m", "epdserve.engine.cli", "router", "--port", str(port)]
    cmd += ["--endpoint", endpoint, "--model", str(models.get("llama"))]
    cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1"]
    log = open(tmp_path_factory.mktemp("router") / "router.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
