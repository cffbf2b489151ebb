"""The decoder's matrix products: ``linear(x, w, b)``, with bf16 weights prepacked on CPUs.

``F.linear`` on a bf16 CPU tensor goes through oneDNN, which reorders the plain ``[N, K]``
weight into its blocked layout on every call. :func:`pack` does that reorder once, at load
(``torch.ops.mkldnn._reorder_linear_weight``), and :func:`linear` runs the packed weight
(``torch.ops.mkldnn._linear_pointwise``): the same oneDNN kernel, so the result is
bit-for-bit ``F.linear``'s, without the per-call reorder. On the 2-CPU AVX512_BF16 machine of
docs/performance.md ("Prepacked bf16 weights") that is 1.1x faster at 2,048 rows and 1.3-3x
at 1-64 rows (decode); where the CPU has AMX, oneDNN's blocked kernels are its AMX ones.

Only bf16 CPU weights are packed, and only where torch's oneDNN supports bf16; anything else
stays a plain tensor and runs ``F.linear``. ``EPDSERVE_PACKED_LINEAR=0`` turns packing off
(to measure with and without). A packed weight is an opaque oneDNN tensor: code that needs the
plain values (a tied embedding, a bench) keeps its own plain tensor. Quantized weights
(int4, fp8: ``quant_linear``) keep their own kernels; :func:`linear` dispatches on them.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from epdserve.kernels import quant_linear
from epdserve.kernels.quant_linear import QuantizedWeight

# the row count oneDNN is told to expect; measured here, the choice between 1 and 2,048
# moves no shape by more than noise, and 64 is a decode batch
ROWS_HINT = 64


def packing_enabled(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` packs ``weight``: bf16, on the CPU, oneDNN with bf16, not off."""
    if os.environ.get("EPDSERVE_PACKED_LINEAR", "1").lower() in ("0", "false", "no"):
        return False
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor | None) -> torch.Tensor | None:
    """``weight`` ``[N, K]`` in oneDNN's blocked layout where :func:`packing_enabled`, else as is.

    The packed tensor replaces the plain one (same memory); drop the plain one after. A
    quantized weight (``quant_linear``) is readied for its own kernel instead."""
    if isinstance(weight, QuantizedWeight):
        weight = quant_linear.pack(weight)  # or, an fp8 weight on a CPU, dequantized
        if isinstance(weight, QuantizedWeight):
            return weight
    if weight is None or not packing_enabled(weight):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight.T + bias`` for a plain, a packed or a quantized ``weight``."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear.quant_linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def is_packed(weight: torch.Tensor | None) -> bool:
    return weight is not None and weight.is_mkldnn
