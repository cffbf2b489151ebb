"""Batch builders and a naive dense attention shared by the kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """A paged-attention batch plus the dense K/V each sequence's context holds."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    dense_k: list[torch.Tensor]
    dense_v: list[torch.Tensor]

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_table,
                self.seq_lens, self.query_start_loc)  # fmt: skip


def cross_layer_cache(num_blocks, block_size, kv_heads, head_dim, dtype, layers=2, layer=1):
    """Per-layer strided K/V views of an engine-style cross-layer cache, filled randomly."""
    kv = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim).to(dtype)
    return kv, kv[:, layer, 0], kv[:, layer, 1]


def make_batch(
    specs, heads, kv_heads, head_dim, block_size, dtype=torch.float32, seed=0, strided=True
):
    """``specs``: list of ``(q_len, ctx_len)``; blocks are assigned in shuffled order.

    The caches are strided per-layer views of a cross-layer cache unless ``strided=False``;
    unused table entries are -1.
    """
    gen = torch.Generator().manual_seed(seed)
    nblks = [-(-ctx // block_size) for _, ctx in specs]
    max_blocks = max(nblks) + 1
    num_blocks = sum(nblks) + 2
    torch.manual_seed(seed)
    _, key_cache, value_cache = cross_layer_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    if not strided:
        key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 = null
    table = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, (_, ctx) in enumerate(specs):
        ids = [perm.pop() for _ in range(nblks[i])]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        idx = torch.tensor(ids)
        dense_k.append(key_cache[idx].reshape(-1, kv_heads, head_dim)[:ctx])
        dense_v.append(value_cache[idx].reshape(-1, kv_heads, head_dim)[:ctx])
    q_lens = torch.tensor([q for q, _ in specs], dtype=torch.int32)
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(qsl[-1]), heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([c for _, c in specs], dtype=torch.int32)
    return Batch(query, key_cache, value_cache, table, seq_lens, qsl, dense_k, dense_v)


def naive_attention(batch: Batch, scale, sliding_window=None, soft_cap=None):
    """Dense fp64 causal attention, one query row and head at a time in matrix form."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    heads, kv_heads = batch.query.shape[1], batch.key_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for i, ctx in enumerate(batch.seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        q = batch.query[a:b].double()
        k = batch.dense_k[i].double().repeat_interleave(heads // kv_heads, dim=1)
        v = batch.dense_v[i].double().repeat_interleave(heads // kv_heads, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        qpos = torch.arange(ctx - (b - a), ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        allowed = kpos <= qpos
        if sliding_window is not None:
            allowed &= kpos > qpos - sliding_window
        logits = logits.masked_fill(~allowed, -math.inf)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v)
    return out


def random_specs(rng, num_seqs, max_ctx):
    """A mixed batch: decodes, chunked prefills (prefix cached) and full prefills."""
    specs = []
    for i in range(num_seqs):
        ctx = int(rng.integers(1, max_ctx + 1))
        kind = i % 3
        q_len = 1 if kind == 0 else ctx if kind == 1 else int(rng.integers(1, ctx + 1))
        specs.append((q_len, ctx))
    return specs


def cpu_backend(name: str):
    """The CPU kernel backend ``name`` (``native`` or ``torch``); skips when it cannot run."""
    import pytest

    from epdserve.kernels.backends import get_backend

    try:
        return get_backend(name, "cpu")
    except ValueError as exc:  # native without a C compiler
        pytest.skip(str(exc))
