"""Bidirectional attention inside image spans (Gemma3), on top of causal paged attention.

Query rows of an image span are recomputed with ``mask = causal(+window) OR same-span``.
The whole span's K/V must already be in the cache, so a span is never split across
scheduler chunks (the scheduler guarantees it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_spans(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    scale: float,
    window: int | None,
) -> None:
    """Overwrite ``out`` rows of every span in ``meta.bidirectional_spans``."""
    block_size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    for seq, start, end in meta.bidirectional_spans:
        q0, q1 = int(meta.query_start_loc[seq]), int(meta.query_start_loc[seq + 1])
        seq_len = int(meta.seq_lens[seq])
        chunk_start = seq_len - (q1 - q0)
        first, last = max(start, chunk_start), min(end, seq_len)
        if first >= last:
            continue
        assert end <= seq_len, f"image span [{start}, {end}) split across chunks"
        blocks = meta.block_table[seq, : -(-end // block_size)].long()
        # a cache stored in fp8 (--kv-cache-dtype) is read back in the queries' dtype
        k = k_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:end].to(q.dtype)
        v = v_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:end].to(q.dtype)
        qpos = torch.arange(first, last)[:, None]
        kpos = torch.arange(end)[None, :]
        causal = kpos <= qpos
        if window is not None:
            causal &= kpos > qpos - window
        mask = causal | ((kpos >= start) & (kpos < end))
        rows = q[q0 + first - chunk_start : q0 + last - chunk_start]  # [R, H, D]
        qh = rows.transpose(0, 1)  # [H, R, D]
        kh = k.transpose(0, 1).repeat_interleave(group, 0)
        vh = v.transpose(0, 1).repeat_interleave(group, 0)
        res = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[q0 + first - chunk_start : q0 + last - chunk_start] = res.transpose(0, 1)
