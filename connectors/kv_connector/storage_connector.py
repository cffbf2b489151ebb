"""KV connectors over a ``BlockStore``: ``RedisConnector`` and ``SharedStorageConnector``.

One class, two roles (``KVConnectorBase``): a scheduler-side instance holds a
``StoreScheduler`` (``storage_scheduler.py``: lookups, loads, saves planned, store-tier
KV events), a worker-side one a ``StoreWorker`` (``storage_worker.py``: blocks moved on
background threads). Both share the store, its ``KVBlockIO`` and their counters.
"""

from __future__ import annotations

from typing import Any, ClassVar

from epdserve.connectors.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVLayout,
    KVRequest,
    KVShard,
    ScheduledRequest,
)
from epdserve.connectors.kv_connector.config import KVTransferConfig
from epdserve.connectors.kv_connector.storage_scheduler import StoreScheduler
from epdserve.connectors.kv_connector.storage_worker import StoreWorker
from epdserve.connectors.storage import (
    BlockStore,
    KVBlockIO,
    KVBlockMeta,
    create_store,
    kv_key,
    store_config,
)
from epdserve.connectors.storage.transfer import rejection_counts

__all__ = ["RedisConnector", "SharedStorageConnector", "StorageConnector"]


class StorageConnector(KVConnectorBase):
    """A connector whose blocks live in a shared ``BlockStore`` named by the config."""

    backend_key: ClassVar[str] = ""  # the extra-config key that selects the backend

    @classmethod
    def check_extra_config(cls, extra: dict[str, Any]) -> None:
        where = "kv_transfer_config.kv_connector_extra_config"
        if cls.backend_key not in extra:
            raise ValueError(f"{where}.{cls.backend_key}: required by {cls.__name__}")
        options = {k: v for k, v in extra.items() if k != "pool"}
        try:
            store_config(options)
            kv_key(str(extra.get("pool", "default")), "0", b"\0")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        layout: KVLayout,
        store: BlockStore | None = None,
        shard: KVShard | None = None,
    ):
        """``shard``: a tensor-parallel rank's heads and collective (worker side; None: the
        cache holds every KV head)."""
        super().__init__(role)
        self.config, self.layout = config, layout
        self.store = store or create_store(config.storage_options())
        meta = KVBlockMeta(
            layout.fingerprint, layout.block_size, layout.hash_algo, layout.num_kv_heads
        )
        heads = shard.heads if shard is not None else None
        self.kv_io = KVBlockIO(self.store, config.pool, meta, heads=heads)
        self.scheduler_side: StoreScheduler | None = None
        self.worker_side: StoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = StoreScheduler(config, layout, self.kv_io)
        else:
            self.worker_side = StoreWorker(self.store, self.kv_io, shard)

    # --- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduled: list[ScheduledRequest]) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduled)

    def request_finished(
        self, request: KVRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(output)

    def take_events(self) -> list:
        return self.scheduler_side.take_events() if self.scheduler_side is not None else []

    def step_failed(self, metadata: KVConnectorMetadata) -> None:
        self.scheduler_side.step_failed(metadata)

    # --- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_cache: Any) -> None:
        self.worker_side.register_kv_caches(kv_cache)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self.worker_side.bind_connector_metadata(metadata)

    def start_load_kv(self) -> None:
        self.worker_side.start_load_kv()

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def take_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = super().take_output(finished_req_ids)  # get_finished first, then the results
        out.saved, out.missed = self.worker_side.take_transfer_results()
        return out

    # --- either side ----------------------------------------------------------------------
    def stats(self) -> KVConnectorStats:
        if self.worker_side is not None:  # what every rank agreed on
            return self.worker_side.stats()
        s = self.kv_io.stats
        return KVConnectorStats(s.saved, s.save_failures, s.loaded, s.misses, s.rejected)

    def rejections(self) -> dict[str, int]:
        if self.worker_side is not None:
            return self.worker_side.rejections()
        return rejection_counts(self.kv_io, self.store)

    def close(self) -> None:
        for side in (self.scheduler_side, self.worker_side):
            if side is not None:
                side.close()
        self.store.close()


class RedisConnector(StorageConnector):
    """Blocks in Redis: ``kv_connector_extra_config = {"url": "redis://host:6379/0", ...}``."""

    backend_key = "url"


class SharedStorageConnector(StorageConnector):
    """Blocks as files on a shared volume: ``kv_connector_extra_config = {"path": "/cache/kv"}``."""

    backend_key = "path"
