"""The runtime LoRA routes exist only when the pod allows runtime updating (the app is built
and driven in process: loading checks the adapter's files in the API process, before the
engine core hears of it; the core is never started here)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from fastapi.testclient import TestClient

from epdserve.engine.config import EngineConfig
from epdserve.engine.entrypoints.openai.api_server import ServerState, build_app
from epdserve.engine.lora.peft_files import WEIGHTS_FILE
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


def rewrite_header(path, change) -> None:
    raw = (path / WEIGHTS_FILE).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    text = change(json.loads(raw[8 : 8 + n]))
    text = text if isinstance(text, bytes) else json.dumps(text).encode()
    (path / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _first_tensor(header: dict, **fields) -> dict:
    name = next(k for k in header if k != "__metadata__")
    header[name].update(fields)
    return header


def _config(path, text: bytes) -> None:
    (path / "adapter_config.json").write_bytes(text)


# issue #41's damaged adapters (each once a 200 then a 400 per request, or a 500): the change
# to a good copy, how the message starts (the file) and the part it names
DEEP = b"[" * 100_000 + b"]" * 100_000
DAMAGED = {
    "f16_over_f32_span": (
        lambda p: rewrite_header(p, lambda h: _first_tensor(h, dtype="F16")),
        "adapter_model.safetensors: malformed header: tensor ",
        "F16 of shape [8, 384] does not fill data_offsets [0, 12288] (12288 bytes)",
    ),
    "deep_config": (
        lambda p: _config(p, b'{"r": ' + DEEP + b"}"),
        "adapter_config.json: ",
        "nested deeper than 16 levels",
    ),
    "deep_header": (
        lambda p: rewrite_header(p, lambda h: b'{"x": ' + DEEP + b"}"),
        "adapter_model.safetensors: malformed header: ",
        "nested deeper than 3 levels",
    ),
    "offset_not_int": (
        lambda p: rewrite_header(p, lambda h: _first_tensor(h, data_offsets=[0, "a"])),
        "adapter_model.safetensors: malformed header: tensor ",
        "data_offsets [0, 'a'] are not two offsets",
    ),
    "config_over_cap": (
        lambda p: _config(p, (p / "adapter_config.json").read_bytes().ljust(2 << 20, b" ")),
        "adapter_config.json: ",
        "larger than 1048576 bytes",
    ),
    "long_path": (lambda p: "/" + "a" * 5000, "lora_path: /aaa", "(File name too long)"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_adapter_is_a_400_naming_the_file_and_part(models, adapter, tmp_path, case):
    damage, start, part = DAMAGED[case]
    client = app_for(models.get("llama"), enable_lora=True, allow_runtime_lora_updating=True)
    path = tmp_path / "bad"
    shutil.copytree(adapter, path)
    path = damage(path) or path
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(path)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    message = r.json()["error"]["message"]
    assert message.startswith(start) and part in message
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
