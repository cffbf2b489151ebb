"""Block gathers for the torch twins: only the blocks a batch needs, into reused buffers."""

from __future__ import annotations

import torch

from epdserve.kernels.workspace import scratch

# below this many bytes per head row, per-row gathers lose to block gather + transpose
MIN_ROW_GATHER_BYTES = 256


def block_ids(block_table: torch.Tensor, rows, num_blocks: int) -> torch.Tensor:
    """The first ``num_blocks`` table entries of ``rows`` (all rows if None), flattened."""
    table = block_table[:, :num_blocks] if rows is None else block_table[rows, :num_blocks]
    return table.reshape(-1).clamp(min=0)  # padding entries may be -1


def gather_blocks(cache: torch.Tensor, ids: torch.Tensor, purpose: str) -> torch.Tensor:
    """Copy blocks ``ids`` of a (possibly strided) cache: ``[len(ids) * block_size, KVH, D]``.

    The cache's inner ``[block_size, KVH, D]`` is contiguous (the engine's per-layer views
    are), so each block is one row of a 2-D view and ``index_select(out=)`` copies it at
    memcpy speed into the reusable buffer named ``purpose``.
    """
    _, bs, kvh, d = cache.shape
    src = cache.flatten(1)
    buf = scratch(purpose, (ids.numel(), bs * kvh * d), cache.dtype, cache.device)
    torch.index_select(src, 0, ids, out=buf)
    return buf.view(-1, kvh, d)


def gather_head_major(cache: torch.Tensor, ids: torch.Tensor, num_seqs: int, purpose: str):
    """Blocks ``ids`` (``num_seqs`` equal runs) as contiguous ``[num_seqs * KVH, L, D]``.

    One pass when possible: each head row (``D`` elements) is gathered straight into its
    head-major place; otherwise blocks are gathered, then transposed.
    """
    num_blocks, bs, kvh, d = cache.shape
    length = ids.numel() // num_seqs * bs
    if kvh == 1:
        return gather_blocks(cache, ids, purpose).view(num_seqs, length, d)
    row_bytes = d * cache.element_size()
    if row_bytes >= MIN_ROW_GATHER_BYTES and cache.stride(0) % d == 0:
        return _gather_rows(cache, ids, num_seqs, purpose)
    blocks = gather_blocks(cache, ids, purpose).view(num_seqs, length, kvh, d)
    out = scratch(purpose + ".t", (num_seqs, kvh, length, d), cache.dtype, cache.device)
    out.copy_(blocks.transpose(1, 2))
    return out.view(num_seqs * kvh, length, d)


def _gather_rows(cache, ids, num_seqs, purpose):
    num_blocks, bs, kvh, d = cache.shape
    stride = cache.stride(0) // d  # in rows of d elements
    rows = torch.as_strided(
        cache, ((num_blocks - 1) * stride + bs * kvh, d), (d, 1), cache.storage_offset()
    )
    nblk = ids.numel() // num_seqs
    heads = torch.arange(kvh, device=cache.device).view(1, kvh, 1, 1)
    offsets = heads + torch.arange(bs, device=cache.device).view(1, 1, 1, bs) * kvh
    row_ids = scratch(purpose + ".ids", (num_seqs, kvh, nblk, bs), torch.int64, cache.device)
    torch.add(offsets, ids.view(num_seqs, 1, nblk, 1).long() * stride, out=row_ids)
    out = scratch(purpose, (num_seqs * kvh * nblk * bs, d), cache.dtype, cache.device)
    torch.index_select(rows, 0, row_ids.view(-1), out=out)
    return out.view(num_seqs * kvh, nblk * bs, d)
