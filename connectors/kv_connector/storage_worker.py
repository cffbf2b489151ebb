"""The worker side of a storage connector: moves whole cross-layer blocks (this rank's KV
heads of them) between the paged KV cache and the store, on two background threads (so saves
never delay a load).

At TP > 1 every rank runs the same loads and saves (the scheduler's metadata is broadcast),
each for its own heads, and finishes them at its own pace. ``get_finished`` makes the ranks
agree before anything is reported: one all-reduce per step while transfers are in flight sums
each transfer's "done here" flag and per-block failure flags, so a transfer is done when it is
done on every rank, and a block failed when it failed on any. Every rank then reports the same
thing, and the output rank's report is the pod's.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from epdserve.connectors.kv_connector.base import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorStats,
    KVShard,
)
from epdserve.connectors.storage import AsyncBlockStore, BlockStore, KVBlockIO
from epdserve.connectors.storage.codec import REJECT_REASONS
from epdserve.connectors.storage.transfer import DECODE_ERROR, STORE_REFUSED, rejection_counts

logger = logging.getLogger(__name__)

REASONS = (*REJECT_REASONS, DECODE_ERROR, STORE_REFUSED)  # summed over ranks in this order


@dataclass
class _Job:
    """A load or save of one ``BlockTransfer`` in flight on this rank."""

    transfer: BlockTransfer
    future: Future
    is_load: bool
    outcome: list[bool] | None = None  # per block, once the future is done here

    def local_flags(self) -> list[int]:
        """``[done here] + [failed here, per block]`` (failures count only once done)."""
        n = len(self.transfer.block_ids)
        if not self.future.done():
            return [0] * (1 + n)
        if self.outcome is None:
            self.outcome = _result(self.future) or [False] * n
        return [1] + [0 if ok else 1 for ok in self.outcome]


class StoreWorker:
    """``StorageConnector``'s worker-side methods (see ``KVConnectorBase``) and state."""

    def __init__(self, store: BlockStore, kv_io: KVBlockIO, shard: KVShard | None = None):
        self.store, self.kv_io, self.shard = store, kv_io, shard
        self._kv_cache = None
        self._meta = KVConnectorMetadata()
        self._loader = AsyncBlockStore(store, name="epd-kv-load")
        self._writer = AsyncBlockStore(store, name="epd-kv-save")
        self._jobs: list[_Job] = []  # in submission order: the same on every rank
        self._open_saves: dict[str, int] = {}  # req -> its saves not yet done on every rank
        self._finishing: set[str] = set()
        self._invalid: set[int] = set()
        # results not yet taken by ``take_transfer_results``: (hash, stored?) of saves done,
        # hashes of full blocks loads found gone or refused
        self._saved: list[tuple[bytes, bool]] = []
        self._missed: list[bytes] = []
        self._counts = dict.fromkeys(("saved", "save_failures", "loaded", "misses"), 0)
        self._group_rejections: dict[str, int] = {}  # at TP > 1: every rank's refusals
        self._summed = [0] * len(REASONS)  # this rank's refusals already in the sums

    def register_kv_caches(self, kv_cache: Any) -> None:
        self._kv_cache = kv_cache

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._meta = metadata or KVConnectorMetadata()

    def start_load_kv(self) -> None:
        for t in self._meta.loads:
            # a load sent again after a failed step replaces the first one (same blocks)
            self._jobs = [
                j for j in self._jobs if not (j.is_load and j.transfer.req_id == t.req_id)
            ]
            args = (self._kv_cache, t.block_ids, t.block_hashes, t.tail_tokens, t.part_heads)
            self._jobs.append(_Job(t, self._loader.submit(self.kv_io.load, *args), True))

    def wait_for_save(self) -> None:
        for t in self._meta.saves:
            args = (self._kv_cache, t.block_ids, t.block_hashes, t.tail_tokens)
            self._jobs.append(_Job(t, self._writer.submit(self.kv_io.save, *args), False))
            self._open_saves[t.req_id] = self._open_saves.get(t.req_id, 0) + 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._finishing |= {r for r in finished_req_ids if r in self._open_saves}
        recving = set()
        for job, failed in self._agreed_done():
            t = job.transfer
            if job.is_load:
                recving.add(t.req_id)
                self._finish_load(t, failed)
            else:
                self._open_saves[t.req_id] -= 1
                self._finish_save(t, failed)
        sending = {r for r in self._finishing if not self._open_saves[r]}
        for rid in sending:
            self._finishing.discard(rid)
            del self._open_saves[rid]
        return sending, recving

    def _finish_load(self, t: BlockTransfer, failed: list[bool]) -> None:
        first_bad = next((i for i, bad in enumerate(failed) if bad), len(failed))
        self._invalid.update(t.block_ids[first_bad:])
        full = len(t.block_hashes) - (1 if t.tail_tokens else 0)  # a tail is no indexed block
        self._missed += [h for h, bad in zip(t.block_hashes[:full], failed, strict=False) if bad]
        self._counts["loaded"] += failed.count(False)
        self._counts["misses"] += failed.count(True)

    def _finish_save(self, t: BlockTransfer, failed: list[bool]) -> None:
        full = len(t.block_hashes) - (1 if t.tail_tokens else 0)
        self._saved += [(h, not bad) for h, bad in zip(t.block_hashes[:full], failed, strict=False)]
        self._counts["saved"] += failed.count(False)
        self._counts["save_failures"] += failed.count(True)

    def _agreed_done(self) -> list[tuple[_Job, list[bool]]]:
        """Jobs done on every rank, with per block whether it failed on any; forgets them.
        One all-reduce at TP > 1 while jobs are in flight (every rank holds the same jobs)."""
        if not self._jobs:
            return []
        flags = [f for job in self._jobs for f in job.local_flags()]
        size = 1
        if self.shard is not None and self.shard.heads.tp_size > 1:
            size = self.shard.heads.tp_size
            flags = self._all_reduce(flags + self._new_rejections())
            for reason, n in zip(REASONS, flags[-len(REASONS) :], strict=True):
                if n:
                    self._group_rejections[reason] = self._group_rejections.get(reason, 0) + n
        done, pending, at = [], [], 0
        for job in self._jobs:
            n = len(job.transfer.block_ids)
            complete, failed = flags[at] == size, [f > 0 for f in flags[at + 1 : at + 1 + n]]
            at += 1 + n
            (done if complete else pending).append((job, failed) if complete else job)
        self._jobs = pending
        return done

    def _new_rejections(self) -> list[int]:
        """This rank's refusals by reason since the last all-reduce (small numbers: a sum in
        fp32, as the shared-memory all-reduce of more than 2 ranks does, stays exact); zeros
        on a replica: the rank that stores its heads counts them."""
        if not self.shard.heads.writes:
            return [0] * len(REASONS)
        counts = rejection_counts(self.kv_io, self.store)
        now = [counts.get(r, 0) for r in REASONS]
        new = [a - b for a, b in zip(now, self._summed, strict=True)]
        self._summed = now
        return new

    def _all_reduce(self, values: list[int]) -> list[int]:
        device = self._kv_cache.device if self._kv_cache is not None else "cpu"
        t = torch.tensor(values, dtype=torch.int64, device=device)
        return self.shard.all_reduce(t).tolist()

    def take_transfer_results(self) -> tuple[list[tuple[bytes, bool]], list[bytes]]:
        """``(hash, stored on every rank?)`` of full blocks whose saves finished, and hashes
        of full blocks loads found missing (or refused) on any rank, since the last call.
        After ``get_finished``, every save of a request it reported done is among them."""
        saved, missed = self._saved, self._missed
        self._saved, self._missed = [], []
        return saved, missed

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def stats(self) -> KVConnectorStats:
        """Blocks moved as all ranks agreed (and values refused), since it started."""
        return KVConnectorStats(**self._counts, rejected=sum(self.rejections().values()))

    def rejections(self) -> dict[str, int]:
        """Values refused (each deleted), by reason: at TP > 1 by every rank, as of the last
        step with transfers in flight."""
        if self.shard is not None and self.shard.heads.tp_size > 1:
            return dict(self._group_rejections)
        return rejection_counts(self.kv_io, self.store)

    def close(self) -> None:
        for worker in (self._loader, self._writer):
            worker.close(close_store=False)


def _result(job: Future) -> list[bool] | None:
    """A finished job's per-block results; None when it raised (a bug, not a backend fault:
    stores never raise on those), which fails every block of it."""
    try:
        return job.result()
    except Exception:
        logger.exception("KV block transfer failed")
        return None
