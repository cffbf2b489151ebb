"""PEFT adapter directories: ``make-model --lora`` writes what peft writes; a bad adapter is
refused at inspection with a message naming the problem."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve.engine.lora.peft_files import (
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    inspect_adapter,
    load_adapter,
)
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
    weights = load_adapter(spec, (adapters[0] / WEIGHTS_FILE).read_bytes())
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


def read_weights(path) -> tuple[dict, bytes]:
    raw = (path / WEIGHTS_FILE).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_weights(path, header: dict | bytes, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    (path / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(text)) + text + data)


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
K0 = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"


def _set(key, **fields):
    def change(header, data):
        header[key].update(fields)
        return header, data

    return change


def _overlap(header, data):  # K0 takes A0's bytes (both [8, 128])
    header[K0]["data_offsets"] = header[A0]["data_offsets"]
    return header, data


def _deep(header, data):
    return b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", data


# safetensors' rules, each broken once: (change to a good header and data, what is named)
BROKEN_HEADERS = {
    "dtype_not_filling_span": (
        _set(A0, dtype="F16"),
        rf"tensor '{A0}': F16 of shape \[8, 128\] does not fill data_offsets",
    ),
    "unknown_dtype": (_set(A0, dtype="F17"), "dtype 'F17' is not a safetensors dtype"),
    "negative_size": (_set(A0, shape=[-8, 128]), r"shape \[-8, 128\] is not a list of sizes"),
    "offset_not_int": (_set(A0, data_offsets=[0, "a"]), r"\[0, 'a'\] are not two offsets"),
    "offset_past_end": (_set(A0, data_offsets=[0, 2**40]), "are not within the"),
    "overlap": (_overlap, "data_offsets start at"),
    "trailing_bytes": (lambda h, d: (h, d + b"\0" * 4), "the tensors end at byte"),
    "metadata_not_strings": (
        lambda h, d: ({**h, "__metadata__": {"format": 1}}, d),
        "__metadata__ is not a map of strings",
    ),
    "entry_not_object": (lambda h, d: ({**h, "x": 5}, d), "tensor 'x' is not an object"),
    "deep": (_deep, r"nested deeper than 3 levels"),
}


@pytest.mark.parametrize("case", BROKEN_HEADERS)
def test_a_header_safetensors_would_refuse_is_refused_naming_the_part(
    llama, adapters, tmp_path, case
):
    change, message = BROKEN_HEADERS[case]
    path = copy_adapter(adapters[0], tmp_path)
    write_weights(path, *change(*read_weights(path)))
    refused(path, llama, f"adapter_model.safetensors: malformed header: .*{message}")


def test_the_checked_header_is_the_one_safetensors_writes(llama, adapters, tmp_path):
    path = copy_adapter(adapters[0], tmp_path)
    header, data = read_weights(path)
    write_weights(path, header, data)  # unpadded, __metadata__ kept: still a valid file
    assert len(inspect_adapter(path, load_model_config(llama), 16).tensors) == 4 * 7


@pytest.mark.parametrize(
    "alpha", ["1e999", "NaN", "-Infinity", "1" + "0" * 400], ids=["inf", "nan", "-inf", "10^400"]
)
def test_a_lora_alpha_that_is_not_a_finite_number_is_named(llama, adapters, tmp_path, alpha):
    path = copy_adapter(adapters[0], tmp_path)
    raw = json.loads((path / "adapter_config.json").read_text())
    text = json.dumps({**raw, "lora_alpha": "A"}).replace('"A"', alpha)
    (path / "adapter_config.json").write_text(text)
    refused(path, llama, "adapter_config.json: lora_alpha must be a finite number")


def test_an_int_too_long_for_python_is_invalid_json_named(llama, adapters, tmp_path):
    path = copy_adapter(adapters[0], tmp_path)
    raw = json.loads((path / "adapter_config.json").read_text())
    text = json.dumps({**raw, "r": "R"}).replace('"R"', "9" * 5000)
    (path / "adapter_config.json").write_text(text)
    refused(path, llama, r"adapter_config.json: not valid JSON \(Exceeds the limit")


def test_a_config_file_is_read_only_up_to_its_cap(llama, adapters, tmp_path):
    path = copy_adapter(adapters[0], tmp_path)
    text = (path / "adapter_config.json").read_bytes()
    (path / "adapter_config.json").write_bytes(text.ljust(MAX_CONFIG_BYTES, b" "))
    assert inspect_adapter(path, load_model_config(llama), 16).rank == 8  # at the cap: read
    (path / "adapter_config.json").write_bytes(text.ljust(MAX_CONFIG_BYTES + 1, b" "))
    refused(path, llama, f"adapter_config.json: larger than {MAX_CONFIG_BYTES} bytes")


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_config_that_is_not_a_regular_file_is_refused_unread(llama, adapters, tmp_path, special):
    path = copy_adapter(adapters[0], tmp_path)
    (path / "adapter_config.json").unlink()
    if special == "fifo":  # no writer: a blocking read would wait forever
        os.mkfifo(path / "adapter_config.json")
    else:  # endless: read whole, it would take all memory
        (path / "adapter_config.json").symlink_to(special)
    refused(path, llama, "adapter_config.json: not a regular file")
