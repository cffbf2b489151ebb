"""Triton ``reshape_and_cache``: one program per token scatters its K and V rows."""

from __future__ import annotations

import triton
import triton.language as tl

from epdserve.kernels.checks import check_reshape_and_cache


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cn, stride_cb, stride_ch,
    block_size, kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < kv_heads) & (d < head_dim)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        dst = blk * stride_cn + off * stride_cb + h * stride_ch + d
        tl.store(kc_ptr + dst, k, mask=mask)
        tl.store(vc_ptr + dst, v, mask=mask)


def reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Triton launcher of ``reshape_and_cache`` (semantics: ``cache_ref.reshape_and_cache_ref``).

    ``key_cache`` and ``value_cache`` must share strides (true for the engine's views).
    """
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same strides")
    for name, t in (("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_cache.shape[1], kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
