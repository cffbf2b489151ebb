"""Triton ``rotary_embedding``: one program per token rotates all q and k heads in place."""

from __future__ import annotations

import triton
import triton.language as tl

from epdserve.kernels.checks import check_rotary


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos, sin, half,
                  IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < num_heads) & (i < half)
    if IS_NEOX:
        off1 = h * stride_h + i
        off2 = off1 + half
    else:
        off1 = h * stride_h + 2 * i
        off2 = off1 + 1
    x1 = tl.load(ptr + off1, mask=mask, other=0.0)
    x2 = tl.load(ptr + off2, mask=mask, other=0.0)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    tl.store(ptr + off1, (f1 * cos - f2 * sin).to(x1.dtype), mask=mask)
    tl.store(ptr + off2, (f2 * cos + f1 * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    q_heads, k_heads, half,
    IS_NEOX: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_R)[None, :]
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(row + half + i, mask=i < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, q_heads, cos, sin, half,
                  IS_NEOX, BLOCK_QH, BLOCK_R)  # fmt: skip
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, k_heads, cos, sin, half,
                  IS_NEOX, BLOCK_KH, BLOCK_R)  # fmt: skip


def rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox):
    """Triton launcher of ``rotary_embedding`` (semantics: ``rotary_ref.rotary_embedding_ref``)."""
    check_rotary(positions, q, k, cos_sin_cache)
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must have a contiguous last dimension")
    num_tokens = q.shape[0]
    half = cos_sin_cache.shape[1] // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            q.shape[1], k.shape[1], half,
            IS_NEOX=bool(is_neox), BLOCK_QH=triton.next_power_of_2(q.shape[1]),
            BLOCK_KH=triton.next_power_of_2(k.shape[1]), BLOCK_R=triton.next_power_of_2(half),
        )  # fmt: skip
    return q, k
