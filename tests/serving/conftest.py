"""A real ``epdserve serve`` subprocess per module, driven over HTTP."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serving_support import API_KEY, ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def server(models):
    srv = ServerProcess(str(models.get("llama")))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
