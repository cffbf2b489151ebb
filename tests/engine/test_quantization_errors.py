"""What a quantized checkpoint that cannot load says: the field, tensor or setting at fault,
before any process starts where the config alone shows it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve.engine.config import EngineConfig
from epdserve.engine.models.loader import load_model
from epdserve.engine.models.quant import resolve
from epdserve.engine.models.quant.write import write_quantized

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gptq(models, tmp_path_factory):
    return write_quantized(models.get("llama"), tmp_path_factory.mktemp("q") / "gptq", "gptq")


def with_config(path, tmp_path, **changes):
    """A copy of checkpoint ``path`` whose quantization_config has ``changes`` (None: drop)."""
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config["quantization_config"].pop(key, None)
        else:
            config["quantization_config"][key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def without_tensor(path, tmp_path, name: str):
    import shutil

    dst = tmp_path / "missing"
    shutil.copytree(path, dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors[name]
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_a_flag_that_contradicts_the_checkpoint_is_refused_naming_quantization(gptq):
    with pytest.raises(ValueError, match=r"^quantization: awq contradicts the checkpoint.*'gptq'"):
        EngineConfig(model=str(gptq), quantization="awq")
    EngineConfig(model=str(gptq), quantization="gptq")  # agreeing is fine


def test_a_quantization_flag_on_an_unquantized_checkpoint_is_refused(models):
    with pytest.raises(ValueError, match="^quantization: fp8 was asked for.*no quantization_conf"):
        EngineConfig(model=str(models.get("llama")), quantization="fp8")


def test_an_unknown_flag_value_is_refused():
    with pytest.raises(ValueError, match="^quantization: must be one of fp8, compressed-tensors"):
        resolve({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"bits": 8}, "quantization_config.bits"),
        ({"group_size": "128"}, "quantization_config.group_size"),
        ({"desc_act": True}, "quantization_config.desc_act: act-order"),
        ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
        ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method: 'bitsandbytes'"),
        ({"quant_method": None}, "quantization_config.quant_method: missing"),
    ],
)
def test_a_malformed_gptq_config_is_refused_naming_the_field(gptq, tmp_path, changes, field):
    path = with_config(gptq, tmp_path, **changes)
    with pytest.raises(ValueError, match="^" + field.replace(".", r"\.")):
        EngineConfig(model=str(path))


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "activation_scheme"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "config_groups"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "config_groups.g.weights.num_bits",
        ),
    ],
)
def test_malformed_awq_and_fp8_configs_are_refused_naming_the_field(raw, field):
    with pytest.raises(ValueError, match=r"^quantization_config\." + field.replace(".", r"\.")):
        resolve(raw)


@pytest.mark.parametrize(
    ("method", "opts", "tensor"),
    [
        ("gptq", {"sym": False}, "model.layers.2.mlp.down_proj.qzeros"),
        ("gptq", {}, "model.layers.0.self_attn.k_proj.scales"),
        ("awq", {}, "model.layers.1.mlp.up_proj.qzeros"),
        ("fp8", {}, "model.layers.3.self_attn.o_proj.weight_scale_inv"),
        ("compressed-tensors", {}, "model.layers.0.self_attn.q_proj.weight_scale"),
        ("compressed-tensors", {"static": True}, "model.layers.0.mlp.gate_proj.input_scale"),
    ],
)
def test_a_missing_scale_or_zero_tensor_is_refused_naming_it(
    models, tmp_path, method, opts, tensor
):
    path = write_quantized(models.get("llama"), tmp_path / method, method, **opts)
    broken = without_tensor(path, tmp_path, tensor)
    with pytest.raises(ValueError, match=f"missing tensor '{tensor}'"):
        load_model(broken, torch.float32, CPU, 64)


def test_an_act_order_g_idx_is_refused_naming_the_tensor(gptq, tmp_path):
    import shutil

    dst = tmp_path / "act-order"
    shutil.copytree(gptq, dst)
    tensors = load_file(dst / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.g_idx"  # 384 rows: 3 groups
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=f"tensor '{name}' permutes input rows"):
        load_model(dst, torch.float32, CPU, 64)


def test_a_quantized_mixture_of_experts_checkpoint_is_refused_naming_quantization(models, tmp_path):
    path = write_quantized(models.get("mixtral"), tmp_path / "moe", "fp8")
    with pytest.raises(ValueError, match=r"^quantization: fp8 .*mixture-of-experts"):
        EngineConfig(model=str(path))
