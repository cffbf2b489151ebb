"""Moves blocks of a paged KV cache to and from a ``BlockStore`` (DESIGN.md §10, "KV layout").

A rank stores one value per block holding the KV heads it holds (``kv_codec.py``): a TP 1
pod one value per block, under the block's key; each rank of a TP 2 pod the half of the heads
it holds, under the key with ``@h{first}+{count}``, written in parallel, no gather. A reader
is told how the values it loads were cut (``part_heads``: heads per value; the writer's TP
decides it) and reads the values that overlap its own heads, taking those: a TP 1 reader two
values of a TP 2 writer, each TP 2 rank the one whole-block value of a TP 1 writer. A block is
stored when every part of it is, and loaded only when every value a rank needs passed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from epdserve.connectors.storage.base import BlockStore, ReasonCounts
from epdserve.connectors.storage.keys import kv_key
from epdserve.connectors.storage.kv_codec import (
    KVBlockMeta,
    KVPart,
    check_kv_block,
    encode_kv_block,
)
from epdserve.connectors.storage.transfer import (
    DECODE_ERROR,
    HostStaging,
    TransferStats,
    account_load,
    check_pairs,
    synchronize,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadSlice:
    """The model's KV heads ``first .. first+count-1`` that one rank's cache holds.

    ``writes``: whether this rank stores them (when TP exceeds the KV heads, the ranks holding
    one head's replicas leave it to the first); ``tp_rank``/``tp_size`` go in what it writes."""

    first: int
    count: int
    writes: bool = True
    tp_rank: int = 0
    tp_size: int = 1


class KVBlockIO:
    """Saves and loads blocks of a paged KV cache ``[num_blocks, layers, 2, block_size,
    heads, head_dim]`` whose ``heads`` are the model's ``self.heads`` (all of them by default).

    One instance per KV-cache group (``group`` > 0 only for hybrid models' extra groups).
    A cache on an accelerator goes through pinned host staging rows; a CPU cache is read and
    written in place unless ``staging=True`` asks for the staged path. A block is copied in
    only once every value of it passed. Counters are per block (``stats``), refusals per
    value (``rejections``, each refused value deleted).
    """

    def __init__(
        self,
        store: BlockStore,
        pool: str,
        meta: KVBlockMeta,
        group: int = 0,
        staging: bool | None = None,
        heads: HeadSlice | None = None,
    ):
        self.store, self.pool, self.meta, self.group = store, pool, meta, group
        self.heads = heads or HeadSlice(0, meta.num_kv_heads)
        first, count, total = self.heads.first, self.heads.count, meta.num_kv_heads
        if count < 1 or total % count or first % count or first + count > total:
            raise ValueError(f"heads {self.heads}: not a slice of {total} KV heads TP can give")
        self.stats = TransferStats()
        self.rejections = ReasonCounts()  # values refused on load, by reason
        self.staging = staging
        self._out, self._in = HostStaging(), HostStaging()

    def key(self, block_hash: bytes | int | str, first: int | None = None, count: int = 0) -> str:
        """The key of the value holding KV heads ``first .. first+count-1`` of a block (by
        default this rank's own); a value of every head has the block's plain key."""
        first = self.heads.first if first is None else first
        count = count or self.heads.count
        part = None if count == self.meta.num_kv_heads else (first, count)
        return kv_key(self.pool, self.meta.fingerprint, block_hash, self.group, part)

    def count_cached_prefix(self, block_hashes: Sequence, part_heads: int = 0) -> int:
        """How many leading blocks of the chain have every part stored now, for values of
        ``part_heads`` heads (default: as this rank writes them). A later load may still
        miss one: eviction, TTL, a fault."""
        return self.count_cached_prefixes(block_hashes, [self._part_heads(part_heads)])[0]

    def count_cached_prefixes(self, block_hashes: Sequence, sizes: Sequence[int]) -> list[int]:
        """``count_cached_prefix`` for values of each of ``sizes`` heads, in one round trip."""
        keys, spans = [], []
        for g in map(self._part_heads, sizes):
            firsts = range(0, self.meta.num_kv_heads, g)
            spans.append((len(keys), len(firsts)))
            keys += [self.key(h, f, g) for h in block_hashes for f in firsts]
        found = self.store.exists_many(keys)
        counts = []
        for start, per in spans:
            whole = _per_block(found[start : start + per * len(block_hashes)], per)
            counts.append(next((i for i, ok in enumerate(whole) if not ok), len(whole)))
        return counts

    def save(
        self,
        kv_cache: torch.Tensor,
        block_ids: Sequence[int],
        block_hashes: Sequence,
        tail_tokens: int = 0,
    ) -> list[bool]:
        """Store this rank's heads of ``kv_cache[block_ids[i]]`` under ``block_hashes[i]``, one
        value per block; per block, whether it was stored. ``tail_tokens`` > 0: the last block
        is a prompt's partial tail, of which only the first ``tail_tokens`` tokens are stored.
        A rank that leaves its heads to a replica stores nothing and reports ``True``. Reads
        the cache only (a whole block of a CPU cache is not even copied before encoding)."""
        check_pairs(block_ids, block_hashes)
        self._check_cache(kv_cache)
        if not self.heads.writes or not block_ids:
            return [True] * len(block_ids)
        blocks, rows = kv_cache, block_ids
        if self._staged(kv_cache):
            blocks, rows = self._out.gather(kv_cache, block_ids), range(len(block_ids))
        h = self.heads
        part = KVPart(h.first, h.count, h.tp_rank, h.tp_size)
        items = []
        for i, (row, block_hash) in enumerate(zip(rows, block_hashes, strict=True)):
            span = blocks[row, :, :, : self._tokens(i, len(block_ids), tail_tokens)]
            key = self.key(block_hash)
            items.append((key, encode_kv_block(span, self.meta, key, part)))
        stored = self.store.put_many(items)
        self.stats.add(saved=sum(stored), save_failures=len(stored) - sum(stored))
        return stored

    def load(
        self,
        kv_cache: torch.Tensor,
        block_ids: Sequence[int],
        block_hashes: Sequence,
        tail_tokens: int = 0,
        part_heads: int = 0,
    ) -> list[bool]:
        """Copy this rank's heads of each stored block into ``kv_cache[block_ids[i]]`` (of the
        last one only its first ``tail_tokens`` tokens when > 0), from values of
        ``part_heads`` heads each (default: as this rank writes them); per block, whether
        every value it needs loaded. Mutates only the slots of loaded blocks."""
        check_pairs(block_ids, block_hashes)
        self._check_cache(kv_cache)
        g, f, c = self._part_heads(part_heads), self.heads.first, self.heads.count
        firsts = range(f - f % g, f + c, g)  # the values overlapping this rank's heads
        n, per = len(block_ids), len(firsts)
        keys = [self.key(h, p, g) for h in block_hashes for p in firsts]
        values = self.store.get_many(keys)
        _, layers, _, _, _, dim = kv_cache.shape
        staged = self._staged(kv_cache)
        rows = self._in.rows(n, kv_cache) if staged else None
        loaded, reasons = [], []
        for i in range(n):
            tokens = self._tokens(i, n, tail_tokens)
            shape, at = (layers, 2, tokens, g, dim), i * per
            checked = [
                self._checked(values[at + k], shape, kv_cache.dtype, keys[at + k], (p, g))
                for k, p in enumerate(firsts)
            ]
            reasons += [reason for _, reason in checked]
            loaded.append(all(payload is not None for payload, _ in checked))
            if loaded[-1]:
                dest = (rows[i] if staged else kv_cache[block_ids[i]])[:, :, :tokens]
                for p, (payload, _) in zip(firsts, checked, strict=True):
                    lo, hi = max(f, p), min(f + c, p + g)
                    _copy_heads(payload, shape, lo - p, hi - p, dest[:, :, :, lo - f : hi - f])
        if staged:
            self._scatter(kv_cache, block_ids, rows, loaded, tail_tokens)
        refused = [any(reasons[i * per : (i + 1) * per]) for i in range(n)]
        self.stats.add(
            lookups=n,
            loaded=sum(loaded),
            rejected=sum(refused),
            misses=n - sum(loaded) - sum(refused),
        )
        account_load(self.store, self.rejections, "KV value", keys, reasons)
        return loaded

    def _checked(self, value, shape, dtype, key: str, heads) -> tuple[memoryview | None, str]:
        """The payload of a value that passed every check, or why not ("" for no value).
        Never raises because of the value: a codec error is a bug, counted as a refusal."""
        if value is None:
            return None, ""
        try:
            return check_kv_block(value, self.meta, shape, dtype, key, heads)
        except Exception:
            logger.exception("checking the stored value of %s failed", key)
            return None, DECODE_ERROR

    def _scatter(self, cache, block_ids, rows, loaded, tail_tokens: int) -> None:
        """The loaded host ``rows`` into their blocks of a device ``cache`` (of a loaded tail,
        its tokens only)."""
        n = len(block_ids)
        full = [i for i in range(n) if loaded[i] and not (tail_tokens and i == n - 1)]
        index = torch.as_tensor(full, dtype=torch.int64)
        self._in.scatter(cache, [block_ids[i] for i in full], rows.index_select(0, index))
        if tail_tokens and n and loaded[-1]:
            t = tail_tokens
            cache[block_ids[-1], :, :, :t].copy_(rows[n - 1, :, :, :t], non_blocking=True)
            if cache.device.type != "cpu":
                synchronize(cache.device)

    def _part_heads(self, part_heads: int) -> int:
        g = part_heads or self.heads.count
        if g < 1 or self.meta.num_kv_heads % g:
            raise ValueError(f"part_heads {g} does not divide {self.meta.num_kv_heads} KV heads")
        return g

    def _tokens(self, i: int, n: int, tail_tokens: int) -> int:
        return tail_tokens if tail_tokens and i == n - 1 else self.meta.block_size

    def _staged(self, kv_cache: torch.Tensor) -> bool:
        return self.staging if self.staging is not None else kv_cache.device.type != "cpu"

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[4] != self.heads.count:
            raise ValueError(
                f"kv_cache {tuple(kv_cache.shape)} does not hold the {self.heads.count} KV "
                f"head(s) {self.heads.first}.. of this KVBlockIO"
            )
        if kv_cache.shape[3] != self.meta.block_size:
            raise ValueError(
                f"kv_cache blocks of {kv_cache.shape[3]} tokens, expected {self.meta.block_size}"
            )


def _copy_heads(payload: memoryview, shape, lo: int, hi: int, dest: torch.Tensor) -> None:
    """Heads ``lo .. hi-1`` of a checked value of ``shape`` ``[layers, 2, tokens, heads,
    dim]`` into ``dest`` (host memory, its last dim contiguous): a plain strided memcpy, as
    torch's ``copy_`` splits large copies over OpenMP threads (slow with the cores busy)."""
    dst = dest.view(torch.uint8).numpy()
    src = np.frombuffer(payload, dtype=np.uint8).reshape(*shape[:-1], -1)
    np.copyto(dst, src[:, :, :, lo:hi])


def _per_block(flags: Sequence[bool], per: int) -> list[bool]:
    """Whether every one of each block's ``per`` consecutive values passed."""
    return [all(flags[i : i + per]) for i in range(0, len(flags), per)]
