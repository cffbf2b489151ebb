"""Torch twin of ``rms_norm`` (optionally fused with the residual add)."""

from __future__ import annotations

import torch

from epdserve.kernels.checks import check_rms_norm


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
):
    """``x / sqrt(mean(x**2, -1) + eps) * weight``, normalized in fp32, cast to ``x.dtype``.

    With ``residual``: ``x = x + residual`` first (in ``x.dtype``, as HF models add the
    residual stream), and the result is ``(rms_norm(x), x)``, the second being the new
    residual. Gemma's ``(1 + w)`` convention is the caller's: pass ``1 + w`` as ``weight``.
    Inputs are not modified.
    """
    check_rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight.dtype == x.dtype != torch.float32:
        # a weight in the model's dtype scales the already rounded normalized values, in
        # that dtype (HF Llama/Qwen: ``weight * hidden.to(input_dtype)``)
        out = (xf * inv).to(x.dtype) * weight
    else:  # fp32 weight (Gemma's 1 + w): everything in fp32, rounded once
        out = (xf * inv * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)
