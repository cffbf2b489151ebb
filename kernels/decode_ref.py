"""Batched decode attention for the torch twin: one query token per sequence.

Every sequence's blocks are gathered (padded to the longest context) and the ``G = H / KVH``
query heads of a kv head become ``G`` query rows of that head, so there is no GQA expansion
and the gathered K/V are read once. Two ways to finish, chosen by measurement
(``bench/kernels.py``):

- SDPA straight on the strided gathered views (fp32 logits inside): the default.
- Two ``bmm`` calls over ``S * KVH`` head-major matrices, with an explicit fp32 softmax:
  used when ``KVH == 1`` (the gathered layout is already head-major, ~10% faster than SDPA)
  and for ``soft_cap`` (SDPA cannot cap). Logits come out of ``bmm`` in the input dtype,
  so bf16 rounds them as HF eager attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.kernels.gather import block_ids, gather_blocks, heads_major
from epdserve.kernels.workspace import scratch


def decode_attention(query, lens, key_cache, value_cache, block_table, scale, window, soft_cap,
                     seqs=None):  # fmt: skip
    """``query [S, H, D]``; sequence ``i`` (row ``seqs[i]`` of the table) has ``lens[i]`` keys."""
    num_seqs, num_heads, head_dim = query.shape
    bs, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // kv_heads
    nblk = -(-max(lens) // bs)
    padded = nblk * bs
    rows = None if seqs is None else torch.tensor(seqs, device=query.device)
    ids = block_ids(block_table, rows, nblk)
    shape = (num_seqs, padded, kv_heads, head_dim)
    if soft_cap is None and kv_heads > 1:
        k = gather_blocks(key_cache, ids, "k").view(shape).transpose(1, 2)
        v = gather_blocks(value_cache, ids, "v").view(shape).transpose(1, 2)
        q = query.view(num_seqs, kv_heads, group, head_dim)
        visible = torch.isfinite(_mask_bias(lens, padded, window, query.device))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None], scale=scale)
        return out.view(num_seqs, num_heads, head_dim)
    k = heads_major(gather_blocks(key_cache, ids, "k").view(shape), "kt")
    q = query.reshape(num_seqs * kv_heads, group, head_dim)
    logits = torch.bmm(q, k.transpose(1, 2)).view(num_seqs, num_heads, padded)
    probs = _softmax(logits, lens, scale, window, soft_cap)
    v = heads_major(gather_blocks(value_cache, ids, "v").view(shape), "vt")
    out = torch.bmm(probs.view(num_seqs * kv_heads, group, padded), v)
    return out.view(num_seqs, num_heads, head_dim)


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
