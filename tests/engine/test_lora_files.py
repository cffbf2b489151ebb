"""PEFT adapter directories: ``make-model --lora`` writes what peft writes; a bad adapter is
refused at inspection with a message naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve.engine.lora.peft_files import WEIGHTS_FILE, inspect_adapter, load_adapter
from epdserve.engine.lora.random_adapters import write_random_adapters
from epdserve.engine.lora.settings import parse_lora_module
from epdserve.engine.models.config import load_model_config


@pytest.fixture(scope="module")
def llama(models):
    return models.get("llama")


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    return write_random_adapters(llama, 2, out=tmp_path_factory.mktemp("loras"))


def copy_adapter(src, tmp_path):
    dst = tmp_path / "adapter"
    shutil.copytree(src, dst)
    return dst


def test_random_adapters_have_peft_key_names_and_load_in_peft(llama, adapters):
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    raw = json.loads((adapters[0] / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    config = LoraConfig(
        r=raw["r"], lora_alpha=raw["lora_alpha"], target_modules=raw["target_modules"]
    )
    expected = get_peft_model_state_dict(get_peft_model(base, config))
    ours = load_file(str(adapters[0] / WEIGHTS_FILE))
    assert set(ours) == set(expected)
    assert all(ours[k].shape == expected[k].shape for k in ours)
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapters[0]))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(layer.lora_B["default"].weight, ours[key])
    assert ours[key].abs().sum() > 0  # B nonzero: the adapter changes outputs


def test_make_model_cli_writes_adapters(tmp_path):
    from epdserve.engine.cli import main

    assert main(["make-model", "--out", str(tmp_path / "m"), "--lora", "2"]) == 0
    names = sorted(p.name for p in (tmp_path / "m" / "loras").iterdir())
    assert names == ["lora0", "lora1"]
    spec = inspect_adapter(
        tmp_path / "m" / "loras" / "lora1", load_model_config(tmp_path / "m"), 16
    )
    assert spec.rank == 16 and spec.scaling == 2.0 and len(spec.tensors) == 4 * 7


def test_inspection_reads_rank_scaling_and_every_module(llama, adapters):
    spec = inspect_adapter(adapters[0], load_model_config(llama), 16)
    assert (spec.rank, spec.scaling, len(spec.modules)) == (8, 2.0, 7)
    weights = load_adapter(spec)
    a, b = weights[3, "down_proj"]
    assert a.shape == (8, 384) and b.shape == (128, 8) and a.dtype == torch.float32


def refused(path, llama, match, max_rank=16):
    with pytest.raises(ValueError, match=match):
        inspect_adapter(path, load_model_config(llama), max_rank)


def test_rank_above_the_maximum_is_named(llama, adapters):
    refused(adapters[1], llama, "rank 16 is above max_lora_rank 8", max_rank=8)


def test_missing_files_are_named(llama, adapters, tmp_path):
    path = copy_adapter(adapters[0], tmp_path)
    (path / WEIGHTS_FILE).unlink()
    refused(path, llama, "adapter_model.safetensors: missing")
    (path / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    refused(path, llama, r"adapter_model.bin is not read: pickle")
    (path / "adapter_config.json").unlink()
    refused(path, llama, "adapter_config.json: missing")
    refused(tmp_path / "nowhere", llama, "is not a directory")


def test_malformed_files_are_named(llama, adapters, tmp_path):
    path = copy_adapter(adapters[0], tmp_path)
    good = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(good[:100])
    refused(path, llama, "malformed")
    (path / WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    refused(path, llama, "malformed")
    (path / "adapter_config.json").write_text("{not json")
    refused(path, llama, "adapter_config.json: not valid JSON")


def test_unknown_target_module_is_named(llama, adapters, tmp_path):
    path = copy_adapter(adapters[0], tmp_path)
    raw = json.loads((path / "adapter_config.json").read_text())
    raw["target_modules"] = ["q_proj", "lm_head"]
    (path / "adapter_config.json").write_text(json.dumps(raw))
    refused(path, llama, "unknown target module 'lm_head'")


def test_a_tensor_of_another_shape_is_named(llama, adapters, tmp_path):
    path = copy_adapter(adapters[0], tmp_path)
    tensors = load_file(str(path / WEIGHTS_FILE))
    key = "base_model.model.model.layers.2.mlp.up_proj.lora_B.weight"
    tensors[key] = torch.zeros(100, 8)
    save_file(tensors, str(path / WEIGHTS_FILE))
    refused(path, llama, r"up_proj.lora_B.weight.*expected a float tensor of shape \[384, 8\]")


def test_lora_modules_items_parse_in_both_forms():
    assert parse_lora_module("a=/x/y") == ("a", "/x/y", None)
    item = '{"name": "b", "path": "/p", "base_model_name": "tiny"}'
    assert parse_lora_module(item) == ("b", "/p", "tiny")
    for bad in ("nopath", "=/p", '{"name": "c"}', '{"name": "c", "path": "/p", "x": 1}'):
        with pytest.raises(ValueError, match="lora_modules"):
            parse_lora_module(bad)
