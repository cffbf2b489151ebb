"""Triton paged attention: one program per (query token, kv head), online softmax over pages.

Each program loads the ``G = H / KVH`` query heads that share its kv head as the rows of a
``[BLOCK_G, D]`` tile (padded to 16 rows for ``tl.dot``) and walks the KV pages from the
first visible position (sliding window) to its own position (causal), one page per step.
Semantics are those of ``attention_ref.paged_attention_ref``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from epdserve.kernels.checks import check_paged_attention


@triton.jit
def _tanh(x):
    # tl has no portable tanh across backends and the interpreter; this form saturates cleanly
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, lens_ptr, qsl_ptr, seq_ids_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh, stride_bt,
    scale, soft_cap, window, group, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    seq = tl.load(seq_ids_ptr + t).to(tl.int64)
    ctx = tl.load(lens_ptr + seq).to(tl.int64)
    q_end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    pos = ctx - (q_end - t)  # the last query of a sequence sits at ctx - 1
    lo = pos * 0
    if USE_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_SIZE)
    d_ok = d < head_dim
    heads = kvh * group + g
    q_mask = (g < group)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0)  # fmt: skip
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j in range(lo // BLOCK_SIZE, pos // BLOCK_SIZE + 1):
        blk = tl.load(bt_ptr + seq * stride_bt + j).to(tl.int64)
        kpos = j * BLOCK_SIZE + n
        k_ok = (kpos >= lo) & (kpos <= pos)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k_off = blk * stride_kn + n[:, None] * stride_kb + kvh * stride_kh + d[None, :]
        k = tl.load(kc_ptr + k_off, mask=kv_mask, other=0.0)
        v_off = blk * stride_vn + n[:, None] * stride_vb + kvh * stride_vh + d[None, :]
        v = tl.load(vc_ptr + v_off, mask=kv_mask, other=0.0)
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = s * scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / l_sum[:, None]
    o_off = t * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_triton(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
    sliding_window=None, soft_cap=None,
):  # fmt: skip
    """Triton launcher of ``paged_attention`` (semantics: ``attention_ref.paged_attention_ref``).

    ``block_size`` must be a power of two >= 16. fp16/bf16 use native-precision ``tl.dot``
    with fp32 accumulation on GPU; fp32 inputs (and every input under ``TRITON_INTERPRET=1``,
    which cannot do bf16 arithmetic) are computed in fp32 with IEEE dots.
    """
    check_paged_attention(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        sliding_window, soft_cap,
    )  # fmt: skip
    native = query.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") != "1"
    return launch(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                  scale, sliding_window, soft_cap, native_dot=native)  # fmt: skip


def launch(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
           sliding_window, soft_cap, native_dot: bool):  # fmt: skip
    """Launch the kernel on validated arguments (tests call this to pick ``native_dot``)."""
    block_size = key_cache.shape[1]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"key_cache block_size must be a power of two >= 16, got {block_size}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must have a contiguous last dimension")
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    kv_heads = key_cache.shape[2]
    group = num_heads // kv_heads
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_ids = torch.repeat_interleave(
        torch.arange(seq_lens.shape[0], device=query.device), q_lens, output_size=num_tokens
    )
    _paged_attention_kernel[(num_tokens, kv_heads)](
        query, key_cache, value_cache, out, block_table, seq_lens, query_start_loc, seq_ids,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        float(scale), float(soft_cap or 1.0), int(sliding_window or 0), group, head_dim,
        BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        NATIVE_DOT=native_dot,
    )  # fmt: skip
    return out
