"""Moves encoder outputs between tensors and a ``BlockStore`` (KV blocks: ``kv_io.py``),
and what both share: host staging buffers, counters, and the accounting of refused values.

This is the layer the engine's KV / encoder-cache connectors call: keys, codec and store
in one place, with counters of what was loaded, missed and refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epdserve.connectors.storage.base import BlockStore, Counters, ReasonCounts
from epdserve.connectors.storage.codec import (
    Decoded,
    EncoderOutputMeta,
    decode_encoder_output,
    encode_encoder_output,
)
from epdserve.connectors.storage.keys import ec_key

logger = logging.getLogger(__name__)


@dataclass
class TransferStats(Counters):
    """Counters of one transfer helper: encoder outputs, or KV blocks (a block counts once,
    whatever the number of its values; ``rejected``: blocks with a value refused)."""

    saved: int = 0  # tensors stored
    save_failures: int = 0  # tensors the store could not take (see the store's stats for why)
    lookups: int = 0  # tensors asked for by load
    loaded: int = 0  # tensors copied into place
    misses: int = 0  # tensors absent (never stored, evicted, expired, backend fault)
    rejected: int = 0  # tensors present but refused (by reason in ``rejections``): deleted


DECODE_ERROR = "decode_error"  # the codec raised on a value (a bug): refused all the same
STORE_REFUSED = "store_refused"  # over the store's max_value_bytes, or not a plain value


def rejection_counts(io, store: BlockStore) -> dict[str, int]:
    """Values refused on load by ``io`` (a ``KVBlockIO`` or ``EncoderOutputIO``), by reason,
    with those its ``store`` refused itself; every one was deleted."""
    counts = io.rejections.snapshot()
    refused = store.stats.rejected
    if refused:
        counts[STORE_REFUSED] = counts.get(STORE_REFUSED, 0) + refused
    return counts


class HostStaging:
    """A reusable host buffer that blocks of a cache pass through: pinned when the cache is
    on an accelerator, so device<->host copies are asynchronous DMA and the store only ever
    sees host memory. Grown on demand; one per transfer direction (not shared by threads)."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def rows(self, n: int, cache: torch.Tensor) -> torch.Tensor:
        """``n`` host rows shaped like ``cache``'s blocks."""
        shape, buf = tuple(cache.shape[1:]), self._buf
        if buf is None or buf.shape[0] < n or buf.shape[1:] != shape or buf.dtype != cache.dtype:
            pinned = cache.device.type == "cuda"
            size = max(n, 2 * buf.shape[0] if buf is not None else 0)
            self._buf = buf = torch.empty((size, *shape), dtype=cache.dtype, pin_memory=pinned)
        return buf[:n]

    def gather(self, cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        """Host copies of ``cache[block_ids]`` (valid until the next call)."""
        host = self.rows(len(block_ids), cache)
        index = torch.as_tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        if cache.device.type == "cpu":
            torch.index_select(cache, 0, index, out=host)
        else:
            host.copy_(cache.index_select(0, index), non_blocking=True)
            synchronize(cache.device)
        return host

    def scatter(self, cache: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        """``cache[block_ids[i]] = host[i]``."""
        if not block_ids:
            return
        index = torch.as_tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        cache.index_copy_(0, index, host.to(cache.device, non_blocking=True))
        if cache.device.type != "cpu":
            synchronize(cache.device)  # the caller's stream may differ (a loader thread)


def synchronize(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


class EncoderOutputIO:
    """Saves and loads encoder outputs (one embedding tensor per multimodal item)."""

    def __init__(self, store: BlockStore, pool: str, fingerprint: str):
        self.store, self.pool = store, pool
        self.meta = EncoderOutputMeta(fingerprint)
        self.stats = TransferStats()
        self.rejections = ReasonCounts()  # values refused on load, by reason

    def key(self, mm_id: str) -> str:
        return ec_key(self.pool, self.meta.fingerprint, mm_id)

    def has(self, mm_ids: Sequence[str]) -> list[bool]:
        """Whether each item's output is stored now; mutates nothing."""
        return self.store.exists_many([self.key(m) for m in mm_ids])

    def save(self, outputs: Sequence[tuple[str, torch.Tensor]]) -> list[bool]:
        """Store each ``(mm_id, embedding)``; per item, whether it was stored."""
        items = []
        for mm_id, tensor in outputs:
            key = self.key(mm_id)
            items.append((key, encode_encoder_output(tensor, self.meta, key)))
        done = self.store.put_many(items)
        self.stats.add(saved=sum(done), save_failures=len(done) - sum(done))
        return done

    def load(
        self,
        mm_ids: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        dtype: torch.dtype,
        outs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor | None]:
        """Each item's embedding (written into ``outs[i]`` when given), ``None`` on a miss."""
        outs = outs if outs is not None else [None] * len(mm_ids)
        for out, shape in zip(outs, shapes, strict=True):
            if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype):
                raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected {shape} {dtype}")
        keys = [self.key(m) for m in mm_ids]
        values = self.store.get_many(keys)
        result, reasons = [], []
        for key, value, shape, out in zip(keys, values, shapes, outs, strict=True):
            decoded = decode_value(decode_encoder_output, value, self.meta, shape, dtype, key, out)
            result.append(decoded.tensor if decoded is not None else None)
            reasons.append(decoded.reason if decoded is not None else "")
        bad, present = sum(bool(r) for r in reasons), sum(v is not None for v in values)
        self.stats.add(
            lookups=len(values), loaded=present - bad, misses=len(values) - present, rejected=bad
        )
        account_load(self.store, self.rejections, "encoder output", keys, reasons)
        return result


def check_pairs(block_ids: Sequence[int], block_hashes: Sequence) -> None:
    if len(block_ids) != len(block_hashes):
        raise ValueError(f"{len(block_ids)} block_ids but {len(block_hashes)} block_hashes")


def decode_value(decode, value, meta, shape, dtype, key: str, out, **checks) -> Decoded | None:
    """``value`` decoded (``None`` when there was none). Never raises because of the value:
    the destination was checked by the caller, so a codec error is a bug, counted as a
    refusal like any other."""
    if value is None:
        return None
    try:
        return decode(value, meta, shape, dtype, key, out=out, **checks)
    except Exception:
        logger.exception("decoding the stored value of %s failed", key)
        return Decoded(None, DECODE_ERROR)


def account_load(store, rejections, what: str, keys, reasons) -> None:
    """Count the values a load refused, by reason, and delete them, so no reader fetches them
    again (the next producer's save stores a good one)."""
    bad = [(k, r) for k, r in zip(keys, reasons, strict=True) if r]
    if not bad:
        return
    rejections.add(r for _, r in bad)
    store.delete_many([k for k, _ in bad])
    logger.warning(
        "refused %d stored %s(s) (%s); deleted them, computing instead",
        len(bad),
        what,
        ", ".join(sorted({r for _, r in bad})),
    )
