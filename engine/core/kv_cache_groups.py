"""KV-cache groups and their per-kind block rules (vLLM v1's hybrid allocator).

Layers that attend the same way share a group; every group has its own block table per
request, and all groups draw from one ``BlockPool``. Groups have the same number of layers
(``slots``), so one block id holds one block of every layer *of its group*: the runner's
cache tensor is ``[num_blocks, slots, 2, block_size, kv_heads, head_dim]``.

- Full attention keeps every block and hits the longest cached prefix, left to right.
- Sliding window (``W`` tokens, a query at ``p`` sees ``(p - W, p]``) frees blocks that fell
  out of every future query's window (their slot in the table becomes the null block) and
  hits right to left: a prefix of ``n`` blocks is usable when the last ``cdiv(W - 1, bs)``
  blocks before it are cached; the blocks before those are not needed at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.engine.core.block_pool import BlockPool, KVCacheBlock
from epdserve.engine.core.hashing import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]
    sliding_window: int | None = None  # None: full attention


@dataclass(frozen=True)
class KVCacheSpec:
    groups: tuple[KVCacheGroup, ...]
    slots: int  # layers per group (the last group of a kind may leave slots unused)

    def layer_placement(self) -> list[tuple[int, int]]:
        """``(group, slot)`` of every layer, in layer order."""
        out = {}
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                out[layer] = (g, slot)
        return [out[i] for i in range(len(out))]

    def blocks_per_request(self, block_size: int, max_len: int, max_chunk: int) -> int:
        """Most blocks one sequence of ``max_len`` tokens holds at once, over all groups: a
        sliding group holds the window before a step's first query plus the step's chunk."""
        whole = cdiv(max_len, block_size)
        return sum(
            whole
            if g.sliding_window is None
            else min(whole, cdiv(g.sliding_window - 1 + max_chunk, block_size) + 1)
            for g in self.groups
        )


def make_kv_cache_spec(layer_windows: list[int | None], hybrid: bool = True) -> KVCacheSpec:
    """Group layers by attention kind. ``hybrid=False`` (or one kind only, full) gives one
    full-attention group holding every layer: the windows are then applied by attention
    alone and no block is ever freed early — what KV connectors need today."""
    n = len(layer_windows)
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    if not hybrid or kinds == [None]:
        return KVCacheSpec((KVCacheGroup(tuple(range(n))),), n)
    by_kind = {w: [i for i, x in enumerate(layer_windows) if x == w] for w in kinds}
    slots = min(len(v) for v in by_kind.values())
    groups = []
    for window in kinds:  # full attention first: group 0 is what KV events describe
        layers = by_kind[window]
        for start in range(0, len(layers), slots):
            groups.append(KVCacheGroup(tuple(layers[start : start + slots]), window))
    return KVCacheSpec(tuple(groups), slots)


class FullAttentionManager:
    """Block rules of one full-attention group."""

    def __init__(self, pool: BlockPool, block_size: int, group_idx: int):
        self.pool = pool
        self.block_size = block_size
        self.group_idx = group_idx

    def find_longest_cache_hit(self, hashes: list[BlockHash]) -> list[KVCacheBlock]:
        hits = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash, self.group_idx)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, pool: BlockPool, block_size: int, group_idx: int, window: int):
        super().__init__(pool, block_size, group_idx)
        self.window = window
        # blocks holding the W - 1 tokens a query right after a hit still sees
        self.needed = max(cdiv(window - 1, block_size), 1)

    def find_longest_cache_hit(self, hashes: list[BlockHash]) -> list[KVCacheBlock]:
        null = self.pool.null_block
        hits = [null] * len(hashes)
        run = 0
        for i in range(len(hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(hashes[i], self.group_idx)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run == self.needed:
                return hits[: i + run]
        return hits[:run]  # fewer than ``needed`` blocks, all from the start

    def remove_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Replace blocks no future query can see by the null block and free them."""
        num_skipped = max(0, num_computed - self.window + 1) // self.block_size
        freed = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was freed already
            freed.append(blocks[i])
            blocks[i] = self.pool.null_block
        self.pool.free_blocks(freed)


def make_managers(spec: KVCacheSpec, pool: BlockPool, block_size: int) -> list:
    return [
        FullAttentionManager(pool, block_size, g)
        if group.sliding_window is None
        else SlidingWindowManager(pool, block_size, g, group.sliding_window)
        for g, group in enumerate(spec.groups)
    ]
