"""Fixtures for prefill/decode disaggregation tests: real ``epdserve serve`` pods."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))  # serving_support
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))  # conftest_helpers

import pytest  # noqa: E402
from conftest_helpers import hf_reference  # noqa: E402,F401
from pd_support import PDPods, ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def colocated(models):
    """A plain colocated pod: the reference every P/D answer must equal."""
    srv = ServerProcess(str(models.get("llama")), "--hash-seed", "7", api_key=None)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def redis_pods(models, redis_server):
    if redis_server.proc is None:
        redis_server.start()
    extra = {"url": redis_server.url, "backoff_initial_s": 0.1, "backoff_max_s": 0.5}
    pods = PDPods(str(models.get("llama")), "RedisConnector", extra)
    yield pods
    pods.stop()


@pytest.fixture(scope="session")
def shared_pods(models, tmp_path_factory):
    volume = tmp_path_factory.mktemp("kv-volume")
    pods = PDPods(str(models.get("llama")), "SharedStorageConnector", {"path": str(volume)})
    pods.volume = volume
    yield pods
    pods.stop()
