"""Batched decode attention for the torch twin: one query token per sequence.

Every sequence's blocks are gathered (padded to the longest context) and the ``G = H / KVH``
query heads of a kv head become ``G`` query rows of that head, so there is no GQA expansion
and the gathered K/V are read once. Two ways to finish, chosen by measurement
(``bench/kernels.py``, 1-2 threads):

- bf16/fp16, or any ``soft_cap`` (SDPA cannot cap): K/V are gathered head-major
  (``gather_head_major``) and attention is two ``bmm`` calls over ``S * KVH`` matrices with
  an explicit fp32 softmax. Logits leave ``bmm`` in the input dtype, so bf16 rounds them
  as HF eager attention does. 10-25% faster than SDPA, whose bf16 CPU kernel repacks K/V.
- fp32: SDPA straight on the strided gathered blocks (fp32 sgemm reads them in place).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.kernels.gather import block_ids, gather_blocks, gather_head_major
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
    if soft_cap is None and query.dtype == torch.float32:
        return _decode_sdpa(query, lens, key_cache, value_cache, ids, scale, window)
    k = gather_head_major(key_cache, ids, num_seqs, "k")
    q = query.reshape(num_seqs * kv_heads, group, head_dim)
    logits = torch.bmm(q, k.transpose(1, 2)).view(num_seqs, num_heads, padded)
    probs = _softmax(logits, lens, scale, window, soft_cap)
    v = gather_head_major(value_cache, ids, num_seqs, "v")
    out = torch.bmm(probs.view(num_seqs * kv_heads, group, padded), v)
    return out.view(num_seqs, num_heads, head_dim)


def _decode_sdpa(query, lens, key_cache, value_cache, ids, scale, window):
    num_seqs, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    shape = (num_seqs, -1, kv_heads, head_dim)
    k = gather_blocks(key_cache, ids, "k").view(shape).transpose(1, 2)
    v = gather_blocks(value_cache, ids, "v").view(shape).transpose(1, 2)
    q = query.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    bias = _mask_bias(lens, k.shape[2], window, query.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None, None], scale=scale)
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
