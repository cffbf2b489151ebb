"""Batched decode attention for the torch twin: one query token per sequence.

Every sequence's blocks are gathered (padded to the longest context) and the ``G = H / KVH``
query heads of a kv head become ``G`` query rows of that head, so there is no GQA expansion
and the gathered K/V are read once. Two ways to finish, chosen by measurement
(``bench/attention_kernels.py``, 1-2 threads):

- fp32 without soft cap: SDPA straight on the strided gathered blocks (fp32 sgemm reads
  them in place).
- otherwise (bf16/fp16, or any ``soft_cap``, which SDPA cannot apply) two ``bmm`` calls and
  an explicit fp32 softmax, 10-50% faster than SDPA, whose bf16 CPU kernel repacks K/V:
  with 2-4 kv heads on a block-diagonal query (no transpose of K/V), otherwise on K/V
  gathered head-major. Logits leave ``bmm`` in the input dtype, so bf16 rounds them as HF
  eager attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.kernels.gather import block_ids, gather_blocks, gather_head_major
from epdserve.kernels.workspace import scratch

# a decode group padded separately holds at least this many sequences (per-call overhead)
MIN_GROUP = 4
# beyond this many kv heads the block-diagonal trick's extra flops cost more than a transpose
MAX_BLOCK_DIAGONAL_KV_HEADS = 4


def length_groups(seqs: list[int], blocks: list[int], max_groups: int = 4) -> list[list[int]]:
    """Split ``seqs`` (with ``blocks[i]`` KV blocks each) into groups padded separately.

    Sequences are ordered by length; the group that pads most is split at its best point
    while that removes over a quarter of its padded blocks and both halves keep
    ``MIN_GROUP`` sequences. Keeps input order when no split happens.
    """
    if len(seqs) < 2 * MIN_GROUP:
        return [seqs] if seqs else []
    order = sorted(range(len(seqs)), key=blocks.__getitem__)
    groups = [order]
    while len(groups) < max_groups:
        best = max(groups, key=lambda g: len(g) * blocks[g[-1]] - sum(blocks[i] for i in g))
        cut = _best_cut(best, blocks)
        if cut is None:
            break
        groups.remove(best)
        groups += [best[:cut], best[cut:]]
    if len(groups) == 1:
        return [seqs]
    return [[seqs[i] for i in g] for g in groups]


def _best_cut(group: list[int], blocks: list[int]) -> int | None:
    cost = len(group) * blocks[group[-1]]
    cuts = range(MIN_GROUP, len(group) - MIN_GROUP + 1)
    best = min(cuts, key=lambda c: c * blocks[group[c - 1]] + (len(group) - c) * blocks[group[-1]],
               default=None)  # fmt: skip
    if best is None:
        return None
    split = best * blocks[group[best - 1]] + (len(group) - best) * blocks[group[-1]]
    return best if split < 0.75 * cost else None


def decode_attention(query, lens, key_cache, value_cache, block_table, scale, window, soft_cap,
                     seqs=None):  # fmt: skip
    """``query [S, H, D]``; sequence ``i`` (row ``seqs[i]`` of the table) has ``lens[i]`` keys."""
    kv_heads = key_cache.shape[2]
    nblk = -(-max(lens) // key_cache.shape[1])
    rows = None if seqs is None else torch.tensor(seqs, device=query.device)
    ids = block_ids(block_table, rows, nblk)
    caches = (key_cache, value_cache)
    if soft_cap is None and query.dtype == torch.float32:
        return _decode_sdpa(query, lens, *caches, ids, scale, window)
    if 2 <= kv_heads <= MAX_BLOCK_DIAGONAL_KV_HEADS:
        return _decode_block_diagonal(query, lens, *caches, ids, scale, window, soft_cap)
    return _decode_head_major(query, lens, *caches, ids, scale, window, soft_cap)


def _decode_head_major(query, lens, key_cache, value_cache, ids, scale, window, soft_cap):
    """K/V gathered as ``[S * KVH, L, D]``; the G heads of a kv head are the bmm rows."""
    num_seqs, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = num_heads // kv_heads
    k = gather_head_major(key_cache, ids, num_seqs, "k")
    q = query.reshape(num_seqs * kv_heads, group, head_dim)
    logits = torch.bmm(q, k.transpose(1, 2)).view(num_seqs, num_heads, -1)
    probs = _softmax(logits, lens, scale, window, soft_cap)
    v = gather_head_major(value_cache, ids, num_seqs, "v")
    out = torch.bmm(probs.view(num_seqs * kv_heads, group, -1), v)
    return out.view(num_seqs, num_heads, head_dim)


def _decode_block_diagonal(query, lens, key_cache, value_cache, ids, scale, window, soft_cap):
    """K/V stay in gathered order ``[S, L, KVH * D]``; q becomes block-diagonal instead.

    ``q_bd[s, h*G + g, h'*D + d] = q[s, h*G + g, d]`` if ``h == h'`` else 0, so one bmm gives
    every head's logits and reads K once without a transpose; ``P @ V`` yields all
    ``KVH x KVH`` head pairs and its diagonal is kept. Costs ``KVH``x the (tiny) flops.
    """
    num_seqs, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = num_heads // kv_heads
    shape = (num_seqs, -1, kv_heads * head_dim)
    q_bd = scratch("q_bd", (num_seqs, kv_heads, group, kv_heads, head_dim), query.dtype,
                   query.device).zero_()  # fmt: skip
    q = query.view(num_seqs, kv_heads, group, head_dim).permute(0, 2, 3, 1)
    torch.diagonal(q_bd, dim1=1, dim2=3).copy_(q)
    k = gather_blocks(key_cache, ids, "k").view(shape)
    logits = torch.bmm(q_bd.view(num_seqs, num_heads, -1), k.transpose(1, 2))
    probs = _softmax(logits, lens, scale, window, soft_cap)
    v = gather_blocks(value_cache, ids, "v").view(shape)
    pairs = torch.bmm(probs, v).view(num_seqs, kv_heads, group, kv_heads, head_dim)
    out = torch.diagonal(pairs, dim1=1, dim2=3).permute(0, 3, 1, 2)
    return out.reshape(num_seqs, num_heads, head_dim)


def _decode_sdpa(query, lens, key_cache, value_cache, ids, scale, window):
    num_seqs, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    shape = (num_seqs, -1, kv_heads, head_dim)
    k = gather_blocks(key_cache, ids, "k").view(shape).transpose(1, 2)
    v = gather_blocks(value_cache, ids, "v").view(shape).transpose(1, 2)
    q = query.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    bias = _mask_bias(lens, k.shape[2], window, query.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None, None], scale=scale)
    # CUDA's SDPA may return a non-contiguous layout (seen on an H200): reshape, not view
    return out.reshape(num_seqs, num_heads, head_dim)


def _softmax(logits, lens, scale, window, soft_cap):
    """fp32 masked softmax of ``logits [S, H, L]`` (in reused buffers), cast to their dtype."""
    num_seqs, num_heads, padded = logits.shape
    work = scratch("logits", tuple(logits.shape), torch.float32, logits.device)
    torch.mul(logits, scale, out=work)
    if soft_cap is not None:
        work.div_(soft_cap).tanh_().mul_(soft_cap)
    work.add_(_mask_bias(lens, padded, window, logits.device)[:, None, :])
    work.sub_(work.amax(dim=-1, keepdim=True)).exp_()
    work.div_(work.sum(dim=-1, keepdim=True))
    if logits.dtype == torch.float32:
        return work
    probs = scratch("probs", tuple(logits.shape), logits.dtype, logits.device)
    return probs.copy_(work)


def _mask_bias(lens, padded: int, window, device) -> torch.Tensor:
    """``[S, L]``: -inf where a key is hidden (padding past the context, outside the window).

    Added to the logits rather than ``masked_fill_``: a broadcast boolean fill is ~20x slower.
    """
    ctx = torch.tensor(lens, device=device)[:, None]
    pos = torch.arange(padded, device=device)[None, :]
    hidden = pos >= ctx
    if window is not None:
        hidden |= pos <= ctx - 1 - window
    return torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))
