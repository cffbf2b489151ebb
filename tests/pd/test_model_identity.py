"""The checkpoint's digest and the hash seed are resolved once, at core start, and passed
down: the weights are read at most once, and only when a store or a derived seed needs them."""

from __future__ import annotations

import pytest
from pd_support import engine_core

from epdserve.engine.config import EngineConfig
from epdserve.engine.kv_transfer import setup


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Every ``weights_digest`` call of the test (the model directory it read)."""
    calls: list[str] = []
    real = setup.weights_digest

    def counted(model_dir: str) -> str:
        calls.append(model_dir)
        return real(model_dir)

    monkeypatch.setattr(setup, "weights_digest", counted)
    return calls


def test_a_pod_with_a_kv_store_an_encoder_store_and_no_seed_reads_its_weights_once(
    models, tmp_path, reads
):
    ec = {"ec_connector": "SharedStorageECConnector", "ec_role": "ec_consumer"}
    ec["ec_connector_extra_config"] = {"path": str(tmp_path / "ec")}
    core = engine_core(models.get("llama"), "prefill", tmp_path, ec_transfer_config=ec)
    assert len(reads) == 1
    digest = core.config.model_digest
    assert core.config.hash_seed == f"epdserve-model:{digest}"
    assert core.executor.worker.ec_connector.io.meta.fingerprint == setup.encoder_fingerprint(
        digest, "float32"
    )
    core.close()


def test_a_pod_that_shares_nothing_never_reads_its_weights(models, reads):
    engine_core(models.get("llama"), hash_seed="given").close()
    engine_core(models.get("llama")).close()
    assert reads == []


def test_a_resolved_config_is_passed_on_as_is(models, reads):
    config = EngineConfig(model=str(models.get("llama")), device="cpu", enable_kv_events=True)
    resolved = setup.resolve_identity(config)
    assert resolved.hash_seed.startswith("epdserve-model:") and len(reads) == 1
    assert setup.resolve_identity(resolved) is resolved and len(reads) == 1
