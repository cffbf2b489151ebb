"""FP8 checkpoints: float8_e4m3fn ``L.weight [N, K]`` and its scales.

- ``quant_method: fp8`` (the Qwen / DeepSeek FP8 releases): with ``weight_block_size``
  ``[bn, bk]``, ``L.weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]`` (despite its name, the
  multiplier: ``w = weight * scale_inv`` of its block); without it, ``L.weight_scale`` per tensor.
  ``activation_scheme`` dynamic, or static with ``L.input_scale``.
- ``quant_method: compressed-tensors``, ``format`` ``float-quantized`` or ``naive-quantized``:
  ``config_groups`` whose ``weights`` are ``{num_bits: 8, type: float, strategy: tensor |
  channel | block}``; ``L.weight_scale`` ``[]``/``[1]`` per tensor, ``[N, 1]`` per channel,
  ``[ceil(N/bn), ceil(K/bk)]`` per block (``block_structure``); ``input_activations`` dynamic,
  or static with ``L.input_scale``. Layers in ``ignore`` are stored plain.

Every form becomes one ``FP8Weight``: a per-tensor scale is repeated per output row, a block
scale is repeated over its block's rows (so q|k|v and gate|up join whatever their sizes).
"""

from __future__ import annotations

import torch

from epdserve.engine.models.quant import QuantMethod, int_field, read_tensor
from epdserve.kernels.quant_linear import FP8, FP8Weight

FP8_CHECKPOINT_DTYPES = ("F8_E4M3", "float8_e4m3fn")


def _is_fp8(reader, name: str) -> bool:
    return reader.has(name) and reader.get_slice(name).get_dtype() in FP8_CHECKPOINT_DTYPES


def _block(value, field: str) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(f"quantization_config.{field}: two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


class FP8Checkpoint(QuantMethod):
    """What both FP8 formats share: ``scale_name`` per layer in one of three forms."""

    scale_name = "weight_scale"
    block: tuple[int, int] | None = None  # [bn, bk]; None: per tensor or per channel
    static_input = False

    def quantizes(self, reader, base: str) -> bool:
        return _is_fp8(reader, base + ".weight")

    def read(self, reader, base, cols, dtype) -> FP8Weight:
        data = read_tensor(reader, base + ".weight", cols)
        if data.dtype != FP8:
            raise ValueError(f"model: tensor {base + '.weight'!r} is {data.dtype}, not fp8 e4m3")
        scale_name = f"{base}.{self.scale_name}"
        if not reader.has(scale_name):
            raise ValueError(f"model: fp8 checkpoint is missing tensor {scale_name!r}")
        n = data.shape[0]
        scale = reader.get(scale_name).float()
        if self.block is None:
            group = None
            if scale.numel() == 1:
                scale = scale.reshape(1, 1).expand(n, 1)
            elif scale.numel() != n:
                raise ValueError(f"model: tensor {scale_name!r} has shape {tuple(scale.shape)}")
            scale = scale.reshape(n, 1)
        else:
            bn, group = self.block
            if cols is not None and (cols[0] % group or cols[1] % group):
                raise ValueError(
                    f"tensor_parallel_size: {base}'s input columns {cols[0]}..{cols[1]} are "
                    f"not whole blocks of {group}"
                )
            k_full = (
                data.shape[1] if cols is None else reader.get_slice(base + ".weight").get_shape()[1]
            )
            if scale.shape != (-(-n // bn), -(-k_full // group)):
                raise ValueError(f"model: tensor {scale_name!r} has shape {tuple(scale.shape)}")
            scale = scale.repeat_interleave(bn, 0)[:n]
            if cols is not None:
                scale = scale[:, cols[0] // group : -(-cols[1] // group)]
        return FP8Weight(data, scale.contiguous(), group, dtype, self._input_scale(reader, base))

    def _input_scale(self, reader, base) -> torch.Tensor | None:
        if not self.static_input:
            return None
        name = base + ".input_scale"
        if not reader.has(name):
            raise ValueError(f"model: static fp8 checkpoint is missing tensor {name!r}")
        return reader.get(name).float().reshape(())


class BlockFP8(FP8Checkpoint):
    name = "fp8"

    def __init__(self, raw: dict):
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config.activation_scheme: dynamic or static, got {scheme!r}"
            )
        self.static_input = scheme == "static"
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt: e4m3 only, got {fmt!r}")
        if raw.get("weight_block_size") is not None:
            self.block = _block(raw["weight_block_size"], "weight_block_size")
            self.scale_name = "weight_scale_inv"


class CompressedFP8(FP8Checkpoint):
    name = "compressed-tensors"

    def __init__(self, raw: dict):
        fmt = raw.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(
                f"quantization_config.format: float-quantized or naive-quantized (fp8) are "
                f"supported, got {fmt!r}"
            )
        groups = raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups: missing or empty")
        schemes = {self._scheme(name, g) for name, g in groups.items()}
        if len(schemes) != 1:
            raise ValueError("quantization_config.config_groups: groups of different schemes")
        self.block, self.static_input = schemes.pop()

    @staticmethod
    def _scheme(name: str, group) -> tuple[tuple[int, int] | None, bool]:
        where = f"config_groups.{name}"
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"quantization_config.{where}.weights: missing")
        int_field(weights, "num_bits", "compressed-tensors fp8", {8}, f"{where}.weights.")
        if weights.get("type") != "float":
            raise ValueError(
                f"quantization_config.{where}.weights.type: float (fp8) is supported, got "
                f"{weights.get('type')!r}"
            )
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(
                f"quantization_config.{where}.weights.strategy: tensor, channel or block, "
                f"got {strategy!r}"
            )
        block = None
        if strategy == "block":
            block = _block(weights.get("block_structure"), f"{where}.weights.block_structure")
        acts = group.get("input_activations")
        static = isinstance(acts, dict) and not acts.get("dynamic", True)
        return block, static
