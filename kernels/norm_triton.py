"""Triton ``rms_norm`` (optionally fused with the residual add): one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epdserve.kernels.checks import check_rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    base = row * hidden
    x = tl.load(x_ptr + base + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + base + cols, mask=mask, other=0.0)
        # round the sum to the storage dtype first: the new residual stream is what we norm
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + base + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + base + cols, (xf * inv * w).to(x.dtype), mask=mask)


def rms_norm_triton(x, weight, eps, residual=None):
    """Triton launcher of ``rms_norm`` (semantics: ``norm_ref.rms_norm_ref``)."""
    check_rms_norm(x, weight, eps, residual)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(x2)
    res2 = x2 if residual is None else residual.reshape(-1, hidden).contiguous()
    new_res = torch.empty_like(x2) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, new_res, hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),  # one row per program: widen for big rows
        )  # fmt: skip
    out = out.view(x.shape)
    return out if residual is None else (out, new_res.view(x.shape))
