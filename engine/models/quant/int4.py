"""4-bit checkpoints: GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ's GEMM layout).

Both keep, per linear layer ``L`` of ``N`` outputs and ``K`` inputs, groups of ``group_size``
input columns with an fp16 scale and a 4-bit zero point each, ``w = (q - zero) * scale``:

- GPTQ: ``L.qweight`` int32 ``[K/8, N]`` (eight input rows per word, row ``8i + j`` in bits
  ``4j..4j+3``), ``L.qzeros`` int32 ``[K/group, N/8]`` (eight outputs per word, in order),
  ``L.scales`` ``[K/group, N]``, ``L.g_idx`` ``[K]`` (each input row's group). Format v1
  (``checkpoint_format`` ``gptq``, the default) stores ``zero - 1``; ``gptq_v2`` stores it as
  is. ``sym`` checkpoints have zero 8. ``desc_act`` (act-order: rows permuted across groups)
  is refused.
- AWQ: ``L.qweight`` int32 ``[K, N/8]`` and ``L.qzeros`` ``[K/group, N/8]``, eight outputs
  per word in AWQ's nibble order (word nibble ``i`` holds output ``8c + ORDER[i]``),
  ``L.scales`` ``[K/group, N]``; ``zero_point`` true, ``version`` gemm.
"""

from __future__ import annotations

import torch

from epdserve.engine.models.quant import QuantMethod, int_field, read_tensor
from epdserve.kernels.quant_linear import Int4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds output 8c + AWQ_ORDER[i]
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[A, B]`` -> ``[A, B, 8]`` of nibbles 0..15, nibble ``i`` = bits ``4i..4i+3``."""
    return (words.to(torch.int32).unsqueeze(-1) >> SHIFTS) & 0xF


def pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """``[A, B, 8]`` of 0..15 -> int32 ``[A, B]`` (the inverse of :func:`unpack_words`)."""
    return (nibbles.to(torch.int32) << SHIFTS).sum(-1, dtype=torch.int64).to(torch.int32)


def _group_size(raw: dict, key: str, method: str) -> int:
    g = int_field(raw, key, method)
    if g < 16 and g != -1:
        raise ValueError(f"quantization_config.{key}: {method} needs -1 or at least 16, got {g}")
    return g


def _need(reader, name: str) -> str:
    if not reader.has(name):
        raise ValueError(f"model: quantized checkpoint is missing tensor {name!r}")
    return name


def _group_cols(cols, group: int | None):
    return None if cols is None else (cols[0] // group, cols[1] // group)


class GPTQ(QuantMethod):
    name = "gptq"

    def __init__(self, raw: dict):
        int_field(raw, "bits", "gptq", {4})
        self.group_size = _group_size(raw, "group_size", "gptq")
        if raw.get("desc_act", False) is not False:
            raise ValueError(
                "quantization_config.desc_act: act-order GPTQ checkpoints (desc_act true) are "
                "not supported; use one quantized with desc_act false"
            )
        self.sym = raw.get("sym", True)
        if not isinstance(self.sym, bool):
            raise ValueError(f"quantization_config.sym: must be true or false, got {self.sym!r}")
        fmt = raw.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format: gptq or gptq_v2, got {fmt!r}")
        self.zero_offset = 1 if fmt == "gptq" else 0

    def quantizes(self, reader, base: str) -> bool:
        return reader.has(base + ".qweight") or not reader.has(base + ".weight")

    def read(self, reader, base, cols, dtype) -> Int4Weight:
        qweight = read_tensor(reader, _need(reader, base + ".qweight"), _word_rows(cols), 0)
        k = qweight.shape[0] * 8
        group, gcols = _groups(self.group_size, k, base, cols)
        scales = read_tensor(reader, _need(reader, base + ".scales"), gcols, 0)
        n = qweight.shape[1]
        if scales.shape != (k // group, n):
            raise ValueError(f"model: tensor {base + '.scales'!r} has shape {tuple(scales.shape)}")
        self._check_g_idx(reader, base, cols, group, k)
        q = unpack_words(qweight).permute(0, 2, 1).reshape(k, n).t()  # [N, K]
        if self.sym:
            zeros = torch.full((n, k // group), 8, dtype=torch.uint8)
        else:
            packed = read_tensor(reader, _need(reader, base + ".qzeros"), gcols, 0)
            zeros = unpack_words(packed).reshape(packed.shape[0], -1)[:, :n] + self.zero_offset
            zeros = zeros.t().to(torch.uint8)
        return Int4Weight.from_ints(q, scales.float().t(), zeros, group, dtype)

    def _check_g_idx(self, reader, base, cols, group, k) -> None:
        if not reader.has(base + ".g_idx"):
            return
        g_idx = read_tensor(reader, base + ".g_idx", cols, 0).to(torch.int64)
        start = 0 if cols is None else cols[0]
        if not torch.equal(g_idx, torch.arange(start, start + k) // group):
            raise ValueError(
                f"model: tensor {base + '.g_idx'!r} permutes input rows across groups "
                "(act-order); not supported"
            )


def _groups(group_size: int, k: int, base: str, cols):
    """``(group, the groups' rows)`` of a weight with ``k`` input columns (``group_size`` -1 or
    0: one group); a rank's ``cols`` must be whole groups (a ``tensor_parallel_size`` error)."""
    group = group_size if group_size > 0 else k
    if cols is not None and (cols[0] % group or cols[1] % group):
        raise ValueError(
            f"tensor_parallel_size: {base}'s input columns {cols[0]}..{cols[1]} are not "
            f"whole groups of {group}"
        )
    return group, _group_cols(cols, group)


def _word_rows(cols):
    return None if cols is None else (cols[0] // 8, cols[1] // 8)


class AWQ(QuantMethod):
    name = "awq"

    def __init__(self, raw: dict):
        int_field(raw, "bits" if "bits" in raw else "w_bit", "awq", {4})
        key = "group_size" if "group_size" in raw else "q_group_size"
        self.group_size = _group_size(raw, key, "awq")
        if raw.get("zero_point", True) is not True:
            raise ValueError("quantization_config.zero_point: awq without zero points (false) "
                             "is not supported")  # fmt: skip
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: awq gemm only, got {version!r}")

    def quantizes(self, reader, base: str) -> bool:
        return reader.has(base + ".qweight") or not reader.has(base + ".weight")

    def read(self, reader, base, cols, dtype) -> Int4Weight:
        qweight = read_tensor(reader, _need(reader, base + ".qweight"), cols, 0)
        k = qweight.shape[0]
        group, gcols = _groups(self.group_size, k, base, cols)
        scales = read_tensor(reader, _need(reader, base + ".scales"), gcols, 0)
        qzeros = read_tensor(reader, _need(reader, base + ".qzeros"), gcols, 0)
        n = scales.shape[1]
        if qweight.shape[1] * 8 != n or qzeros.shape != (k // group, n // 8):
            raise ValueError(f"model: awq tensors of {base!r} disagree in shape")
        q = awq_unpack(qweight).t()  # [N, K]
        zeros = awq_unpack(qzeros).t().to(torch.uint8)
        return Int4Weight.from_ints(q, scales.float().t(), zeros, group, dtype)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 ``[A, B]`` -> ``[A, 8B]`` of 0..15 in output order."""
    nibbles = unpack_words(words)  # [A, B, 8], word nibble i
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles
    return out.reshape(words.shape[0], -1)


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """``[A, 8B]`` of 0..15 -> AWQ's int32 ``[A, B]`` (inverse of :func:`awq_unpack`)."""
    grouped = q.reshape(q.shape[0], -1, 8)
    return pack_words(grouped[..., list(AWQ_ORDER)])
