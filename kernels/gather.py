"""Block gathers for the torch twins: only the blocks a batch needs, into reused buffers."""

from __future__ import annotations

import torch

from epdserve.kernels.workspace import scratch


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


def heads_major(x: torch.Tensor, purpose: str) -> torch.Tensor:
    """``x [S, L, KVH, D]`` -> contiguous ``[S * KVH, L, D]`` (a view when ``KVH == 1``)."""
    s, length, kvh, d = x.shape
    if kvh == 1:
        return x.view(s, length, d)
    out = scratch(purpose, (s, kvh, length, d), x.dtype, x.device)
    out.copy_(x.transpose(1, 2))
    return out.view(s * kvh, length, d)
