"""The worker side of a storage connector: moves whole cross-layer blocks between the paged
KV cache and the store, on two background threads (so saves never delay a load)."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Any

from epdserve.connectors.kv_connector.base import BlockTransfer, KVConnectorMetadata
from epdserve.connectors.storage import AsyncBlockStore, BlockStore, KVBlockIO

logger = logging.getLogger(__name__)


class StoreWorker:
    """``StorageConnector``'s worker-side methods (see ``KVConnectorBase``) and state."""

    def __init__(self, store: BlockStore, kv_io: KVBlockIO):
        self.kv_io = kv_io
        self._kv_cache = None
        self._meta = KVConnectorMetadata()
        self._loader = AsyncBlockStore(store, name="epd-kv-load")
        self._writer = AsyncBlockStore(store, name="epd-kv-save")
        self._loads: dict[str, tuple[Future, list[int]]] = {}
        self._saves: dict[str, list[Future]] = {}
        self._finishing: set[str] = set()
        self._invalid: set[int] = set()
        # saves not yet reported in an output, and hashes loads missed (appended on the
        # loader thread): the scheduler side turns them into store-tier KV events
        self._unreported: list[tuple[Future, list[bytes]]] = []
        self._missed: deque[bytes] = deque()

    def register_kv_caches(self, kv_cache: Any) -> None:
        self._kv_cache = kv_cache

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._meta = metadata or KVConnectorMetadata()

    def start_load_kv(self) -> None:
        for t in self._meta.loads:
            self._loads[t.req_id] = (self._loader.submit(self._load, t), t.block_ids)

    def _load(self, t: BlockTransfer) -> list[bool]:
        # kv_io deletes the values it refuses (damaged, mislabelled, of another model)
        loaded = self.kv_io.load(self._kv_cache, t.block_ids, t.block_hashes)
        self._missed.extend(h for h, ok in zip(t.block_hashes, loaded, strict=True) if not ok)
        return loaded

    def wait_for_save(self) -> None:
        for t in self._meta.saves:
            job = self._writer.submit(self.kv_io.save, self._kv_cache, t.block_ids, t.block_hashes)
            self._saves.setdefault(t.req_id, []).append(job)
            self._unreported.append((job, t.block_hashes))

    def take_transfer_results(self) -> tuple[list[tuple[bytes, bool]], list[bytes]]:
        """``(hash, stored?)`` of saves finished and hashes loads missed since the last call.
        After ``get_finished``, every save of a request it reported done is among them."""
        saved, pending = [], []
        for job, hashes in self._unreported:
            if not job.done():
                pending.append((job, hashes))
                continue
            ok = job.result() if job.exception() is None else None
            saved += zip(hashes, ok or [False] * len(hashes), strict=True)
        self._unreported = pending
        missed = [self._missed.popleft() for _ in range(len(self._missed))]
        return saved, missed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._finishing |= {r for r in finished_req_ids if r in self._saves}
        sending = {r for r in self._finishing if all(f.done() for f in self._saves[r])}
        for rid in sending:
            self._finishing.discard(rid)
            for job in self._saves.pop(rid):
                _result(job, "save")
        recving = {r for r, (job, _) in self._loads.items() if job.done()}
        for rid in recving:
            job, block_ids = self._loads.pop(rid)
            loaded = _result(job, "load") or [False] * len(block_ids)
            first_bad = next((i for i, ok in enumerate(loaded) if not ok), len(block_ids))
            self._invalid.update(block_ids[first_bad:])
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def close(self) -> None:
        for worker in (self._loader, self._writer):
            worker.close(close_store=False)


def _result(job: Future, what: str):
    try:
        return job.result()
    except Exception:  # a bug, not a backend fault (stores never raise on those)
        logger.exception("KV block %s failed", what)
        return None
