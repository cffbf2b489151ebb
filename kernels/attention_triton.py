"""Triton paged attention: one program per (query tile, kv head), online softmax over pages.

A query tile is up to ``BLOCK_Q`` consecutive query tokens of ONE sequence; its rows are
``(token, head)`` pairs for the ``G = H / KVH`` query heads that share the program's kv
head, ``BLOCK_Q * BLOCK_G`` rows in all (>= 16 for ``tl.dot``). The program walks the KV
pages from the first position any row may see (sliding window) to the last (causal), one
page per step, so a prefill reads each page once per tile instead of once per token. Decode
batches (``T == S``) use ``BLOCK_Q = 1``. Semantics: ``attention_ref.paged_attention_ref``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from epdserve.kernels.checks import check_paged_attention

ROWS_PER_TILE = 64  # BLOCK_Q * BLOCK_G for prefill tiles


@triton.jit
def _tanh(x):
    # tl has no portable tanh across backends and the interpreter; this form saturates cleanly
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, lens_ptr, qsl_ptr, tile_seq_ptr, tile_idx_ptr,
    num_seqs, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh, stride_bt,
    scale, soft_cap, window, group, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    if seq < num_seqs:
        ctx = tl.load(lens_ptr + seq).to(tl.int64)
        q_start = tl.load(qsl_ptr + seq).to(tl.int64)
        q_len = tl.load(qsl_ptr + seq + 1).to(tl.int64) - q_start
        first = tl.load(tile_idx_ptr + tile).to(tl.int64) * BLOCK_Q  # first query of the tile
        r = tl.arange(0, BLOCK_Q * BLOCK_G)
        qi = first + r // BLOCK_G
        g = r % BLOCK_G
        d = tl.arange(0, BLOCK_D)
        row_ok = (qi < q_len) & (g < group)
        d_ok = d < head_dim
        pos = ctx - q_len + qi  # absolute position of each row's query
        t = q_start + qi
        heads = kvh * group + g
        q_off = t[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        last = tl.minimum(ctx - q_len + first + BLOCK_Q - 1, ctx - 1)
        lo = pos * 0
        lo_tile = last * 0
        if USE_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
            lo_tile = tl.maximum(ctx - q_len + first - window + 1, 0)
        acc = _attend_pages(q, kc_ptr, vc_ptr, bt_ptr + seq * stride_bt, kvh, pos, lo,
                            lo_tile, last, d, d_ok,
                            stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
                            scale, soft_cap, BLOCK_SIZE, BLOCK_Q * BLOCK_G, BLOCK_D,
                            USE_SOFT_CAP, NATIVE_DOT)  # fmt: skip
        o_off = t[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _attend_pages(
    q, kc_ptr, vc_ptr, table_ptr, kvh, pos, lo, lo_tile, last, d, d_ok,
    stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
    scale, soft_cap,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax of the rows of ``q`` over the pages holding positions ``lo_tile..last``.

    Row ``i`` sees keys ``lo[i] <= kpos <= pos[i]``; nothing outside ``lo_tile..last`` is even
    loaded, so unwritten slots past the context never reach the sums.
    """
    n = tl.arange(0, BLOCK_SIZE)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(lo_tile // BLOCK_SIZE, last // BLOCK_SIZE + 1):
        blk = tl.load(table_ptr + j).to(tl.int64)
        kpos = j * BLOCK_SIZE + n
        visible = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= lo[:, None])
        kv_mask = ((kpos >= lo_tile) & (kpos <= last))[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + blk * stride_kn + n[:, None] * stride_kb + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        v = tl.load(vc_ptr + blk * stride_vn + n[:, None] * stride_vb + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = s * scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new
    return acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]


def paged_attention_triton(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
    sliding_window=None, soft_cap=None, step_cache=None,
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
                  scale, sliding_window, soft_cap, native_dot=native,
                  step_cache=step_cache)  # fmt: skip


def launch(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
           sliding_window, soft_cap, native_dot: bool, block_q: int | None = None,
           step_cache: dict | None = None):  # fmt: skip
    """Launch the kernel on validated arguments (tests pick ``native_dot`` and ``block_q``).
    The tile map is built once per step when ``step_cache`` is given (every layer shares it)."""
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
    block_g = triton.next_power_of_2(group)
    if block_q is None:  # shapes only: no device sync to learn the query lengths
        decode = num_tokens == seq_lens.shape[0]
        block_q = 1 if decode else max(1, ROWS_PER_TILE // block_g)
    block_g = max(block_g, triton.cdiv(16, block_q))  # tl.dot needs >= 16 rows
    key = ("tiles", num_tokens, block_q)
    tiles = None if step_cache is None else step_cache.get(key)
    if tiles is None:
        tiles = _tiles(query_start_loc, num_tokens, block_q)
        if step_cache is not None:
            step_cache[key] = tiles
    tile_seq, tile_idx = tiles
    _paged_attention_kernel[(tile_seq.shape[0], kv_heads)](
        query, key_cache, value_cache, out, block_table, seq_lens, query_start_loc,
        tile_seq, tile_idx, seq_lens.shape[0],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        float(scale), float(soft_cap or 1.0), int(sliding_window or 0), group, head_dim,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_G=block_g,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        NATIVE_DOT=native_dot,
    )  # fmt: skip
    return out


def _tiles(query_start_loc, num_tokens: int, block_q: int):
    """Per program: its sequence (``>= S`` for spare programs) and tile index in it.

    The grid is the upper bound ``T // BLOCK_Q + S`` so no device sync is needed.
    """
    num_seqs = query_start_loc.shape[0] - 1
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    tiles = torch.zeros(num_seqs + 1, dtype=torch.int64, device=query_start_loc.device)
    tiles[1:] = torch.cumsum((q_lens + block_q - 1) // block_q, 0)
    grid = torch.arange(num_tokens // block_q + num_seqs, device=query_start_loc.device)
    tile_seq = torch.searchsorted(tiles[1:], grid, right=True)
    tile_idx = grid - tiles[tile_seq.clamp(max=num_seqs)]
    return tile_seq, tile_idx
