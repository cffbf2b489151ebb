"""Quantized linear weights: kept quantized in memory, dequantized inside the product.

Two kinds, each one canonical layout whatever checkpoint format it came from (the formats'
readers live in ``engine/models/quant``):

- :class:`Int4Weight`: 4-bit integers ``q`` with a scale and an integer zero point per group
  of ``group`` input columns, ``w = (q - zero) * scale``; ``qdata`` is ``uint8 [N, K/2]``, the
  even input column in the low nibble;
- :class:`FP8Weight`: float8_e4m3fn ``data [N, K]`` with an fp32 ``scale [N, ceil(K/group)]``
  (``group`` None: one scale per output row), ``w = data * scale``.

Both join along the output dimension under ``torch.cat`` (the loader's q|k|v and gate|up
fusion) and slice along either dimension (tensor parallelism). :func:`pack` readies one for
its device; :func:`quant_linear` runs the product (``kernels.linear.linear`` dispatches here).

CPU: int4 in bf16/fp16 runs torch's weight-packed kernel (``_weight_int4pack_mm_for_cpu``; it
needs ``N % 16 == 0``, other shapes dequantize per product); in fp32 it dequantizes per product
(bit for bit the dequantized weight; torch's kernel takes fp32 too, but 8 rows cost it 99 ms
against 23 + 5 ms dequantized, at the 0.5B shape's gate|up on one thread); fp8 is
dequantized to the model dtype at load (CPUs have no fp8 arithmetic and the per-product upcast
measured ~55x slower than bf16's product), or, with ``EPDSERVE_FP8_CPU_WEIGHTS=fp8``, kept
in fp8 and upcast per product. CUDA: int4 runs ``quant_triton``'s dequant-GEMM,
fp8 with per-row scales runs ``torch._scaled_mm`` on activations quantized per token.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class QuantizedWeight:
    """A weight ``[N, K]`` stored quantized; ``torch.cat`` along dim 0 joins two of a kind."""

    kind = "quantized"
    shape: tuple[int, int]
    dtype: torch.dtype  # the activations' dtype (the model's)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat and kwargs.get("dim", args[1] if len(args) > 1 else 0) == 0:
            parts = list(args[0])
            if all(type(p) is type(parts[0]) for p in parts):
                return type(parts[0]).join(parts)
        raise TypeError(f"{cls.__name__}: {func.__name__} is not supported (only torch.cat dim 0)")

    @property
    def is_mkldnn(self) -> bool:  # kernels.linear.is_packed asks every weight
        return False

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding this weight (what it costs in memory)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _groups_of(k0: int, k1: int, group: int | None, what: str) -> tuple[int, int] | None:
    if group is None:
        return None
    if k0 % group or k1 % group:
        raise ValueError(
            f"tensor_parallel_size: {what}'s input columns {k0}..{k1} are not whole groups "
            f"of {group} (each rank's slice of a quantized weight must be)"
        )
    return k0 // group, k1 // group


class Int4Weight(QuantizedWeight):
    kind = "int4"

    def __init__(self, qdata, scales, zeros, group: int, dtype: torch.dtype):
        n, half = qdata.shape
        assert qdata.dtype == torch.uint8 and scales.shape == zeros.shape == (n, 2 * half // group)
        self.qdata, self.scales, self.zeros = qdata, scales.float(), zeros.to(torch.uint8)
        self.group, self.dtype, self.shape = group, dtype, (n, 2 * half)
        self.packed = self.scales_zeros = None  # the CPU kernel's form, set by pack()

    @staticmethod
    def from_ints(q: torch.Tensor, scales, zeros, group: int, dtype) -> Int4Weight:
        """From ``q`` ``[N, K]`` of values 0..15."""
        q = q.to(torch.uint8)
        return Int4Weight(q[:, ::2] | (q[:, 1::2] << 4), scales, zeros, group, dtype)

    def ints(self) -> torch.Tensor:
        """``q`` ``[N, K]`` as uint8 0..15."""
        low, high = self.qdata & 0xF, self.qdata >> 4
        return torch.stack([low, high], -1).reshape(self.shape)

    @staticmethod
    def join(parts: list[Int4Weight]) -> Int4Weight:
        first = parts[0]
        assert all(p.group == first.group and p.packed is None for p in parts), "join before pack"
        cat = [torch.cat([getattr(p, a) for p in parts]) for a in ("qdata", "scales", "zeros")]
        return Int4Weight(*cat, first.group, first.dtype)

    def dequantize(self, dtype=None) -> torch.Tensor:
        if self.packed is not None:
            raise RuntimeError("Int4Weight: dequantize before pack")
        (n, k), g = self.shape, self.group
        q = torch.stack([self.qdata & 0xF, self.qdata >> 4], -1).view(n, k // g, g).float()
        q.sub_(self.zeros.float().unsqueeze(-1)).mul_(self.scales.unsqueeze(-1))
        return q.view(n, k).to(dtype or self.dtype)

    def tensors(self):
        if self.packed is not None:
            return [self.packed, self.scales_zeros]
        return [self.qdata, self.scales, self.zeros]


class FP8Weight(QuantizedWeight):
    kind = "fp8"

    def __init__(self, data, scale, group: int | None, dtype, input_scale=None):
        n, k = data.shape
        width = 1 if group is None else -(-k // group)
        assert data.dtype == FP8 and scale.shape == (n, width), (scale.shape, n, width)
        self.data, self.scale, self.group, self.dtype = data, scale.float(), group, dtype
        self.input_scale = input_scale  # a static activation scale (fp32 scalar) or None
        self.shape = (n, k)
        self.scale_row = None  # [1, N] fp32 for torch._scaled_mm, set by pack() on CUDA

    @staticmethod
    def join(parts: list[FP8Weight]) -> FP8Weight:
        first = parts[0]
        assert all(p.group == first.group for p in parts), "fp8 parts of different groups"
        scales = [p.input_scale for p in parts if p.input_scale is not None]
        # one input feeds every part: the largest static scale covers them all
        static = torch.stack(scales).max() if scales else None
        data = torch.cat([p.data for p in parts])
        return FP8Weight(
            data, torch.cat([p.scale for p in parts]), first.group, first.dtype, static
        )

    def dequantize(self, dtype=None) -> torch.Tensor:
        w = self.data.float()
        if self.group is None:
            w = w * self.scale
        else:
            w = w * self.scale.repeat_interleave(self.group, 1)[:, : self.shape[1]]
        return w.to(dtype or self.dtype)

    def tensors(self):
        return [self.data, self.scale]


def slice_rows(w: QuantizedWeight, start: int, end: int) -> QuantizedWeight:
    """Output rows ``start..end`` (column parallel)."""
    if isinstance(w, Int4Weight):
        return Int4Weight(
            w.qdata[start:end], w.scales[start:end], w.zeros[start:end], w.group, w.dtype
        )
    return FP8Weight(w.data[start:end], w.scale[start:end], w.group, w.dtype, w.input_scale)


def slice_cols(w: QuantizedWeight, k0: int, k1: int, what: str) -> QuantizedWeight:
    """Input columns ``k0..k1`` (row parallel): whole groups only (``ValueError``)."""
    if isinstance(w, Int4Weight):
        g0, g1 = _groups_of(k0, k1, w.group, what)
        q = w.qdata[:, k0 // 2 : k1 // 2]
        return Int4Weight(q, w.scales[:, g0:g1], w.zeros[:, g0:g1], w.group, w.dtype)
    groups = _groups_of(k0, k1, w.group, what)
    scale = w.scale if groups is None else w.scale[:, groups[0] : groups[1]]
    return FP8Weight(w.data[:, k0:k1], scale, w.group, w.dtype, w.input_scale)


def cpu_int4_supported(w: Int4Weight) -> bool:
    n, k = w.shape
    return (
        n % 16 == 0 and k % w.group == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def fp8_kept_on_cpu() -> bool:
    """``EPDSERVE_FP8_CPU_WEIGHTS=fp8``: keep fp8 weights on the CPU (1 byte a weight, upcast
    per product); default ``dequantize``: the model dtype at load (see :func:`pack`)."""
    value = os.environ.get("EPDSERVE_FP8_CPU_WEIGHTS", "dequantize").lower()
    if value not in ("fp8", "dequantize"):
        raise ValueError(f"EPDSERVE_FP8_CPU_WEIGHTS: fp8 or dequantize, got {value!r}")
    return value == "fp8"


def pack(w: QuantizedWeight) -> QuantizedWeight | torch.Tensor:
    """Ready ``w`` for its device's kernel (in place; returns ``w``). An fp8 weight on the CPU
    becomes a plain tensor of the model dtype unless :func:`fp8_kept_on_cpu`: CPUs have no fp8
    arithmetic, and upcasting per product cost 30 ms for the 0.5B shape's 9,728 x 896 gate|up
    against 0.54 ms in bf16 (docs/performance.md, "Quantized weights")."""
    device = w.tensors()[0].device
    if isinstance(w, FP8Weight) and device.type == "cpu" and not fp8_kept_on_cpu():
        return w.dequantize()
    if isinstance(w, Int4Weight) and device.type == "cpu" and w.dtype != torch.float32:
        if cpu_int4_supported(w):
            int4_cpu_pack(w)
    elif isinstance(w, FP8Weight) and device.type == "cuda" and w.group is None:
        w.scale_row = w.scale.reshape(1, -1).contiguous()
    return w


def int4_cpu_pack(w: Int4Weight) -> Int4Weight:
    """``w`` in the form of torch's CPU int4 kernel (in place): its packed nibbles and
    ``[K/group, N, 2]`` scales and offsets in the activations' dtype."""
    ints = w.ints().to(torch.int32)
    w.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(ints, 1)
    # the kernel computes (q - 8) * scale + offset: offset = (8 - zero) * scale
    offset = (8.0 - w.zeros.float()) * w.scales
    sz = torch.stack([w.scales, offset], -1).transpose(0, 1).contiguous()
    w.scales_zeros = sz.to(w.dtype)
    w.qdata = w.scales = w.zeros = None
    return w


def quant_linear(x: torch.Tensor, w: QuantizedWeight, bias=None) -> torch.Tensor:
    """``x @ dequantize(w).T + bias`` without materialising more than one layer's weight."""
    if isinstance(w, Int4Weight):
        if w.packed is not None:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), w.packed, w.group, w.scales_zeros
            )
            return out if bias is None else out + bias
        if x.is_cuda:
            from epdserve.kernels.quant_triton import int4_matmul

            out = int4_matmul(x, w.qdata, w.scales, w.zeros, w.group)
            return out if bias is None else out + bias
    elif w.scale_row is not None and x.is_cuda:
        return fp8_scaled_mm(x, w, bias)
    return F.linear(x, w.dequantize(x.dtype), bias)


def fp8_scaled_mm(x: torch.Tensor, w: FP8Weight, bias=None) -> torch.Tensor:
    """``torch._scaled_mm`` on fp8 activations (a static per-tensor scale, else per token)."""
    rows = x.reshape(-1, x.shape[-1])
    if w.input_scale is not None:
        x_scale = w.input_scale.float().reshape(1, 1).expand(rows.shape[0], 1).contiguous()
    else:
        x_scale = rows.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    xq = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(
        xq, w.data.t(), scale_a=x_scale, scale_b=w.scale_row, out_dtype=torch.bfloat16
    )
    out = out.to(x.dtype)
    return (out if bias is None else out + bias).reshape(*x.shape[:-1], -1)
