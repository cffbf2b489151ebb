"""The runtime LoRA routes exist only when the pod allows runtime updating (the app is built
and driven in process: loading checks the adapter's files in the API process, before the
engine core hears of it; the core is never started here)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from epdserve.engine.config import EngineConfig
from epdserve.engine.entrypoints.openai.api_server import ServerState, build_app
from epdserve.engine.lora.random_adapters import write_random_adapters


def app_for(model, **lora) -> TestClient:
    config = EngineConfig(model=str(model), device="cpu", **lora)
    return TestClient(build_app(ServerState(config, "tiny", None)))  # no lifespan: no core


@pytest.fixture(scope="module")
def adapter(models, tmp_path_factory):
    return write_random_adapters(models.get("llama"), 1, out=tmp_path_factory.mktemp("l"))[0]


def test_the_routes_are_absent_unless_runtime_updating_is_allowed(models, adapter, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    client = app_for(models.get("llama"), enable_lora=True)
    body = {"lora_name": "a", "lora_path": str(adapter)}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


def test_vllms_variable_allows_runtime_updating(models, adapter, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    client = app_for(models.get("llama"), enable_lora=True)
    body = {"lora_name": "a", "lora_path": str(adapter)}
    r = client.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully."
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "a"]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(adapter)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_loading_on_a_pod_without_lora_is_refused(models, adapter):
    client = app_for(models.get("llama"), allow_runtime_lora_updating=True)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)})
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_a_bad_lora_modules_adapter_fails_the_start_naming_it(models, tmp_path):
    with pytest.raises(ValueError, match="lora_modules: b: lora_path: .* is not a directory"):
        app_for(models.get("llama"), enable_lora=True, lora_modules=[f"b={tmp_path}/none"])
