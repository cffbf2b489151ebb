"""Quantized checkpoints: which format a checkpoint is in, and how its linear layers load.

A checkpoint's ``config.json`` ``quantization_config`` names its ``quant_method``; the engine
setting ``quantization`` (vLLM's ``--quantization``) may name it too, and must then agree.
Supported, in their on-disk layouts (each module says which tensors it reads):

- ``gptq`` (``int4.GPTQ``): 4-bit, ``qweight`` packed along the input, ``desc_act`` false;
- ``awq`` (``int4.AWQ``): 4-bit GEMM layout, ``qweight`` packed along the output;
- ``fp8`` (``fp8.BlockFP8``): float8_e4m3fn with ``weight_scale_inv`` per 128x128 block (the
  Qwen / DeepSeek FP8 releases), or per tensor (``weight_scale``);
- ``compressed-tensors`` (``fp8.CompressedFP8``): float8_e4m3fn with ``weight_scale`` per
  tensor, per channel or per block.

A method's ``load`` returns a ``kernels.quant_linear`` weight, kept quantized in memory;
embeddings, norms and the LM head stay in the model dtype (none of these formats quantizes
them by default).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

METHODS = ("fp8", "compressed-tensors", "gptq", "awq")


class QuantMethod(ABC):
    """How one checkpoint format's linear layers are read."""

    name: str

    @abstractmethod
    def quantizes(self, reader, base: str) -> bool:
        """Whether the checkpoint holds linear layer ``base`` (``...q_proj``) quantized (False:
        a plain ``base.weight``, e.g. a layer the format left out). Reads no tensor data."""

    @abstractmethod
    def read(self, reader, base: str, cols: tuple[int, int] | None, dtype: torch.dtype):
        """The ``QuantizedWeight`` of ``base``: every output row, input columns ``cols``
        (None: all; else whole groups). ``dtype``: the model's activation dtype."""


def read_tensor(reader, name: str, cols=None, cols_dim: int = 1) -> torch.Tensor:
    """``name`` from the checkpoint, only ``cols`` (``[start, end)`` along ``cols_dim``)."""
    if cols is None:
        return reader.get(name)
    view = reader.get_slice(name)
    return view[cols[0] : cols[1]] if cols_dim == 0 else view[:, cols[0] : cols[1]]


def int_field(raw: dict, key: str, method: str, allowed=None, where: str = "") -> int:
    """``raw[key]``, an integer (of ``allowed``); else an error naming
    ``quantization_config.<where><key>``."""
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or (allowed and value not in allowed):
        want = f"one of {sorted(allowed)}" if allowed else "an integer"
        raise ValueError(f"quantization_config.{where}{key}: {method} needs {want}, got {value!r}")
    return value


def resolve(raw: dict, flag: str | None = None) -> QuantMethod | None:
    """The method of a checkpoint whose ``quantization_config`` is ``raw`` ({}: none), checked
    against the ``quantization`` setting ``flag`` (None: take the checkpoint's). Errors name
    the setting or the config field."""
    if flag is not None and flag not in METHODS:
        raise ValueError(f"quantization: must be one of {', '.join(METHODS)}, got {flag!r}")
    if not raw:
        if flag is not None:
            raise ValueError(
                f"quantization: {flag} was asked for, but the checkpoint has no "
                "quantization_config (its weights are not quantized)"
            )
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("quant_method"), str):
        raise ValueError("quantization_config.quant_method: missing or not a string")
    method = raw["quant_method"].lower()
    if method not in METHODS:
        raise ValueError(
            f"quantization_config.quant_method: {method!r} is not supported; supported: "
            f"{', '.join(METHODS)}"
        )
    if flag is not None and flag != method:
        raise ValueError(
            f"quantization: {flag} contradicts the checkpoint, whose quantization_config "
            f"says quant_method {method!r}"
        )
    from epdserve.engine.models.quant import fp8, int4

    build = {
        "gptq": int4.GPTQ,
        "awq": int4.AWQ,
        "fp8": fp8.BlockFP8,
        "compressed-tensors": fp8.CompressedFP8,
    }
    return build[method](raw)


def for_model(config, flag: str | None = None) -> QuantMethod | None:
    """:func:`resolve` of a parsed ``ModelConfig``; a quantized mixture-of-experts checkpoint
    is refused (its experts load through ``moe_weights``, which reads no quantized layout)."""
    method = resolve(config.quantization, flag)
    if method is not None and config.is_moe:
        raise ValueError(
            f"quantization: {method.name} checkpoints of mixture-of-experts models "
            f"({config.architecture}) are not supported: their experts' quantized weights "
            "are not read"
        )
    return method


def input_group(raw: dict) -> int | None:
    """How many input columns share a scale in a checkpoint of ``raw`` quantization_config
    (a row-parallel rank's slice must be whole groups); None: whole rows or no groups."""
    method = str(raw.get("quant_method", "")).lower() if isinstance(raw, dict) else ""
    if method in ("gptq", "awq"):
        group = raw.get("group_size", raw.get("q_group_size"))
        return group if isinstance(group, int) and group > 0 else None
    if method == "fp8" and isinstance(raw.get("weight_block_size"), list):
        return raw["weight_block_size"][-1]
    if method == "compressed-tensors":
        for group in (raw.get("config_groups") or {}).values():
            block = (group.get("weights") or {}).get("block_structure")
            if isinstance(block, list) and block:
                return block[-1]
    return None


def on_device(w, device: torch.device):
    """``w`` with its tensors contiguous on ``device``."""
    from epdserve.kernels.quant_linear import FP8Weight, Int4Weight

    def to(t):
        return None if t is None else t.to(device).contiguous()

    if isinstance(w, Int4Weight):
        return Int4Weight(to(w.qdata), to(w.scales), to(w.zeros), w.group, w.dtype)
    assert isinstance(w, FP8Weight), type(w)
    return FP8Weight(to(w.data), to(w.scale), w.group, w.dtype, to(w.input_scale))
