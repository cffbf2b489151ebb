"""Write a plain checkpoint's decoder linear layers in a quantized format's on-disk layout
(round to nearest: no calibration, so a test or a bench gets a checkpoint of each layout).

``write_quantized(src, dst, method)`` copies ``src`` to ``dst`` with every layer's q/k/v/o and
gate/up/down ``weight`` replaced by the format's tensors and ``quantization_config`` added to
``config.json``; ``dequantized`` (a folder) also gets the plain checkpoint of the values the
quantized one stands for, in fp32, for a reference that knows no quantization.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from epdserve.engine.models.quant.int4 import awq_pack, pack_words
from epdserve.kernels.quant_linear import FP8, FP8_MAX

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128
BLOCK = [128, 128]


def quantize_int4(w: torch.Tensor, group: int, sym: bool):
    """``(q [N, K] 0..15, scales fp16 [N, K/group], zeros [N, K/group])`` of ``w`` ``[N, K]``."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    if sym:
        scales = (g.abs().amax(-1) / 7.5).clamp(min=1e-6).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-6).half()
        zeros = (-lo / scales.float()).round().clamp(0, 15).to(torch.int32)
    q = (g / scales.float().unsqueeze(-1)).round() + zeros.unsqueeze(-1)
    return q.clamp(0, 15).to(torch.int32).reshape(n, k), scales, zeros


def dequantize_int4(q, scales, zeros, group: int) -> torch.Tensor:
    s = scales.float().repeat_interleave(group, 1)
    return (q.float() - zeros.float().repeat_interleave(group, 1)) * s


def gptq_tensors(w, group=GROUP, sym=True, v2=False) -> tuple[dict, torch.Tensor]:
    q, scales, zeros = quantize_int4(w, group, sym)
    n, k = q.shape
    stored = zeros if v2 else (zeros - 1) & 0xF  # format v1 stores zero - 1
    tensors = {
        "qweight": pack_words(q.t().reshape(k // 8, 8, n).permute(0, 2, 1)),
        "qzeros": pack_words(stored.t().reshape(k // group, n // 8, 8)),
        "scales": scales.t().contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32) // group,
    }
    return tensors, dequantize_int4(q, scales, zeros, group)


def awq_tensors(w, group=GROUP) -> tuple[dict, torch.Tensor]:
    q, scales, zeros = quantize_int4(w, group, sym=False)
    tensors = {
        "qweight": awq_pack(q.t().contiguous()),
        "qzeros": awq_pack(zeros.t().contiguous()),
        "scales": scales.t().contiguous(),
    }
    return tensors, dequantize_int4(q, scales, zeros, group)


def fp8_tensors(w, strategy: str, static: bool = False) -> tuple[dict, torch.Tensor]:
    """``strategy``: tensor, channel or block (``BLOCK``); scale name as the formats spell it."""
    w = w.float()
    n, k = w.shape
    if strategy == "block":
        bn, bk = BLOCK
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = w.abs()
        amax = pad.reshape(pad.shape[0] // bn, bn, -1, bk).amax((1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    else:
        amax = w.abs().amax() if strategy == "tensor" else w.abs().amax(1, keepdim=True)
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = scale
    data = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    tensors = {"weight": data, "weight_scale": scale.reshape(-1) if strategy == "tensor" else scale}
    if static:
        tensors["input_scale"] = torch.tensor([0.02])
    return tensors, data.float() * full


def config_for(method: str, **opts) -> dict:
    if method == "gptq":
        fmt, group = "gptq_v2" if opts.get("v2") else "gptq", opts.get("group", GROUP)
        return dict(quant_method="gptq", bits=4, group_size=group, desc_act=False,
                    sym=opts.get("sym", True), checkpoint_format=fmt, damp_percent=0.01)  # fmt: skip
    if method == "awq":
        group = opts.get("group", GROUP)
        return dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm")
    if method == "fp8":
        return dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                    weight_block_size=BLOCK)  # fmt: skip
    strategy, static = opts.get("strategy", "channel"), opts.get("static", False)
    weights = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    if strategy == "block":
        weights["block_structure"] = BLOCK
    acts = dict(num_bits=8, type="float", symmetric=True, dynamic=not static,
                strategy="tensor" if static else "token")  # fmt: skip
    group = dict(targets=["Linear"], weights=weights, input_activations=acts)
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"],
            "quantization_status": "compressed"}  # fmt: skip


def layer_tensors(method: str, w: torch.Tensor, **opts) -> tuple[dict, torch.Tensor]:
    if method == "gptq":
        group = opts.get("group", GROUP)
        return gptq_tensors(w, group, sym=opts.get("sym", True), v2=opts.get("v2", False))
    if method == "awq":
        return awq_tensors(w, opts.get("group", GROUP))
    if method == "fp8":
        tensors, deq = fp8_tensors(w, "block")
        tensors["weight_scale_inv"] = tensors.pop("weight_scale")
        return tensors, deq
    return fp8_tensors(w, opts.get("strategy", "channel"), opts.get("static", False))


def write_quantized(src, dst, method: str, dequantized=None, dtype=None, **opts) -> Path:
    """``dst``: ``src`` with its decoder linear layers in ``method``'s layout (``opts``:
    ``group`` for the int4 formats, ``sym``/``v2`` for gptq, ``strategy``/``static`` for
    compressed-tensors); other tensors keep their values, in ``dtype`` where given."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    if dequantized is not None:
        shutil.copytree(src, dequantized, ignore=shutil.ignore_patterns("*.safetensors*"))
    quantized, plain = {}, {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                t = f.get_tensor(name)
                base, _, leaf = name.rpartition(".")
                if leaf == "weight" and base.rpartition(".")[2] in PROJECTIONS:
                    tensors, deq = layer_tensors(method, t, **opts)
                    quantized.update({f"{base}.{k}": v.contiguous() for k, v in tensors.items()})
                    plain[name] = deq
                else:
                    kept = t if dtype is None else t.to(dtype)
                    quantized[name] = kept
                    plain[name] = t.float()
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = config_for(method, **opts)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if dequantized is not None:
        save_file(plain, str(Path(dequantized) / "model.safetensors"), metadata={"format": "pt"})
        config.pop("quantization_config")
        config["torch_dtype"] = config["dtype"] = "float32"
        (Path(dequantized) / "config.json").write_text(json.dumps(config, indent=2))
    return dst
