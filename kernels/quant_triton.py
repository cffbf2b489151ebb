"""Triton int4 dequant-GEMM: ``x @ ((q - zero) * scale).T`` with the 4-bit weight unpacked
tile by tile in registers, never in memory (the layout of ``quant_linear.Int4Weight``:
``qdata`` ``uint8 [N, K/2]``, even input column in the low nibble; fp32 ``scales`` and uint8
``zeros`` ``[N, K/group]``). The dequantized tile is rounded to ``x``'s dtype (bf16/fp16 run the
tensor cores; fp32 runs exact fp32 products, not tf32); accumulates in fp32; output in ``x``'s
dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, groups,
    GROUP: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * K + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        wmask = col_ok[:, None] & k_ok[None, :]
        byte = tl.load(q_ptr + cols[:, None] * (K // 2) + ks[None, :] // 2, mask=wmask, other=0)
        q = (byte.to(tl.int32) >> ((ks[None, :] % 2) * 4)) & 0xF
        g = cols[:, None] * groups + ks[None, :] // GROUP
        scale = tl.load(s_ptr + g, mask=wmask, other=0.0)
        zero = tl.load(z_ptr + g, mask=wmask, other=0).to(tl.float32)
        w = ((q.to(tl.float32) - zero) * scale).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def int4_matmul(x, qdata, scales, zeros, group: int) -> torch.Tensor:
    """``x [..., K] @ W.T`` for the int4 weight ``W [N, K]``; ``group`` input columns a scale."""
    n, k = qdata.shape[0], 2 * qdata.shape[1]
    assert x.shape[-1] == k and k % group == 0, (x.shape, k, group)
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block_k = min(64, group)
        block_m = 16 if x2.shape[0] <= 16 else 64
        grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(n, 64))
        _int4_matmul_kernel[grid](
            x2, qdata.contiguous(), scales.contiguous(), zeros.contiguous(), out,
            x2.shape[0], n, k, k // group,
            GROUP=group, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
