"""A paged KV cache stored in fp8 (``float8_e4m3fn``, per-tensor scale 1.0) under any backend.

``StoredKVDtype`` wraps a ``KernelBackend``: new keys and values are rounded to the cache's
dtype as they are written (clamped to e4m3's +-448 first, so a large value saturates);
attention gathers the blocks the batch's block table names, reads them back up to the query's
dtype, and runs the wrapped backend's attention over that compact copy with a renumbered
table. So every backend (the native C kernels and the Triton kernels included, which read
bf16/fp32 caches only) attends fp8 caches unchanged, at the cost of one gather and upcast of
the batch's blocks per layer. On CPUs that pass is C (``native.fp8_blocks``: a table lookup
per byte, torch's cast bit for bit, ~3-10x faster than it) and the native backend's kernels
follow it, which beat the torch twin there (``bench/kv_cache_dtype.py``, two runs on 2 busy
cores: decode at 0.48x and 0.83x of a bf16 cache's rate; with torch's cast 0.17x and 0.28x;
the torch twin after the C pass 0.44x). The other ops pass through.
"""

from __future__ import annotations

import torch

from epdserve.kernels import native
from epdserve.kernels.backends import KernelBackend
from epdserve.kernels.checks import check_index

FP8_DTYPES = (torch.float8_e4m3fn,)


class StoredKVDtype(KernelBackend):
    """``inner``'s ops over a KV cache stored in ``kv_dtype`` (one of ``FP8_DTYPES``)."""

    def __init__(self, inner: KernelBackend, kv_dtype: torch.dtype = torch.float8_e4m3fn):
        if kv_dtype not in FP8_DTYPES:
            raise ValueError(f"kv_cache_dtype: {kv_dtype} is not a stored KV dtype")
        self.inner, self.kv_dtype = inner, kv_dtype
        self.name = f"{inner.name}+{str(kv_dtype).removeprefix('torch.')}"

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        check_index("slot_mapping", slot_mapping, 1)
        if key_cache.dtype != self.kv_dtype or value_cache.dtype != self.kv_dtype:
            raise ValueError(
                f"key_cache/value_cache must be {self.kv_dtype}, got {key_cache.dtype}"
            )
        slots = slot_mapping.long()
        valid = (slots >= 0)[:, None, None]
        # a padding slot (-1) rewrites slot 0 of the null block with what it holds: no host
        # sync to drop it (graph-safe), and the null block is never any request's
        slots = slots.clamp(min=0)
        where = (slots // key_cache.shape[1], slots % key_cache.shape[1])
        for new, cache in ((key, key_cache), (value, value_cache)):
            held = cache.view(torch.uint8)
            written = torch.where(valid, self._stored(new).view(torch.uint8), held[where])
            held.index_put_(where, written)

    def _stored(self, t: torch.Tensor) -> torch.Tensor:
        most = torch.finfo(self.kv_dtype).max
        return t.clamp(-most, most).to(self.kv_dtype)

    def paged_attention(
        self,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window=None,
        soft_cap=None,
        step_cache=None,  # not passed on: the readable copy's table is this call's own
    ) -> torch.Tensor:
        keys, values, table = readable_blocks(key_cache, value_cache, block_table, query.dtype)
        return self.inner.paged_attention(
            query, keys, values, table, seq_lens, query_start_loc, scale, sliding_window, soft_cap
        )

    def rms_norm(self, x, weight, eps, residual=None):
        return self.inner.rms_norm(x, weight, eps, residual)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        return self.inner.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        return self.inner.fused_moe(x, w13, w2, topk_weights, topk_ids)


def readable_blocks(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks ``block_table [S, MB]`` names, in ``dtype`` (``[S * MB, block_size, heads,
    dim]`` each), and the table renumbered to them (row ``i``'s blocks are ``i * MB ..``).
    Entries past a sequence's blocks (negative ones included) read the null block 0, which
    attention ignores as it ignored the entry. Static shapes: no host sync, graph-safe."""
    check_index("block_table", block_table, 2)
    ids = block_table.reshape(-1).long().clamp_(min=0)
    keys, values = (_read_back(cache, ids, dtype) for cache in (key_cache, value_cache))
    renumbered = torch.arange(ids.numel(), dtype=block_table.dtype, device=block_table.device)
    return keys, values, renumbered.view(block_table.shape)


def _read_back(cache: torch.Tensor, ids: torch.Tensor, dtype) -> torch.Tensor:
    if native.fp8_blocks_supports(cache, dtype):  # one pass in C: torch's cast is ~10x slower
        return native.fp8_blocks(cache, ids, dtype)
    return cache.index_select(0, ids).to(dtype)
