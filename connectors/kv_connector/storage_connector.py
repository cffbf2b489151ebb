"""KV connectors over a ``BlockStore``: ``RedisConnector`` and ``SharedStorageConnector``.

Scheduler side: looks up how many leading prompt blocks the store holds (or trusts the
hashes a prefill pod handed over), queues loads into freshly allocated blocks, and asks for
each block to be saved once, right after the forward that fills it. Worker side: loads and
saves whole cross-layer blocks on two background threads (so saves never delay a load).
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

from epdserve.connectors.kv_connector.base import (
    BlockTransfer,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVRequest,
    ScheduledRequest,
)
from epdserve.connectors.kv_connector.config import KVTransferConfig
from epdserve.connectors.kv_events import STORE_MEDIUM, BlockRemoved, BlockStored, hash_to_int
from epdserve.connectors.kv_events.keys import extend_keys
from epdserve.connectors.storage import (
    AsyncBlockStore,
    BlockStore,
    KVBlockIO,
    KVBlockMeta,
    create_store,
    kv_key,
    store_config,
)
from epdserve.connectors.storage.transfer import rejection_counts

logger = logging.getLogger(__name__)

LOOKUP_WAIT_S = 0.005  # a healthy store answers within this; a slower one is asked again later


@dataclass(frozen=True)
class KVLayout:
    """What makes stored blocks interchangeable between pods (see DESIGN.md §3)."""

    fingerprint: str  # model + dtype + cache geometry
    block_size: int
    hash_algo: str


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
    ):
        super().__init__(role)
        self.config, self.layout = config, layout
        self.store = store or create_store(config.storage_options())
        meta = KVBlockMeta(layout.fingerprint, layout.block_size, layout.hash_algo)
        self.kv_io = KVBlockIO(self.store, config.pool, meta)
        self._warned = False
        # scheduler side
        self._known_prefix: dict[str, int] = {}  # req -> leading blocks the store holds
        self._lookups: dict[str, Future] = {}  # req -> store lookup in flight
        self._lookup_pool = None
        if role == KVConnectorRole.SCHEDULER:
            self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="epd-kv-lookup")
        self._saved_upto: dict[str, int] = {}  # req -> blocks saved (or skipped) so far
        self._has_saves: set[str] = set()
        self._queued_loads: list[BlockTransfer] = []
        # block hash -> (parent hash, tokens, extra keys) of planned saves, for store events
        self._save_plans: dict[bytes, tuple[bytes | None, list[int], Any]] = {}
        self._events: list = []  # store-tier KV events not yet taken
        # worker side
        self._kv_cache = None
        self._meta = KVConnectorMetadata()
        self._loader = self._writer = None
        if role == KVConnectorRole.WORKER:
            self._loader = AsyncBlockStore(self.store, name="epd-kv-load")
            self._writer = AsyncBlockStore(self.store, name="epd-kv-save")
        self._loads: dict[str, tuple[Future, list[int]]] = {}
        self._saves: dict[str, list[Future]] = {}
        self._finishing: set[str] = set()
        self._invalid: set[int] = set()
        # saves not yet reported in an output, and hashes loads missed (appended on the
        # loader thread): the scheduler side turns them into store-tier KV events
        self._unreported: list[tuple[Future, list[bytes]]] = []
        self._missed: deque[bytes] = deque()

    # --- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        known = self._known(request)
        if known is None:
            return None, False
        if not self.config.is_consumer:
            return 0, False
        n = max(0, known * self.layout.block_size - num_computed_tokens)
        return n, n > 0

    def _known(self, request: KVRequest) -> int | None:
        """Leading blocks in the store (prompt's last token excluded: it must be computed);
        None while the store has not answered, so a slow store never stalls the engine."""
        rid = request.request_id
        if rid in self._known_prefix:
            return self._known_prefix[rid]
        job = self._lookups.get(rid)
        if job is None:
            hashes = request.block_hashes[: (request.num_tokens - 1) // self.layout.block_size]
            trusted = self._handed_over(request, hashes)
            if trusted is not None or not hashes:
                self._known_prefix[rid] = trusted or 0
                return self._known_prefix[rid]
            job = self._lookup_pool.submit(self.kv_io.count_cached_prefix, hashes)
            self._lookups[rid] = job
        try:
            found = job.result(timeout=LOOKUP_WAIT_S)
        except TimeoutError:
            return None
        self._known_prefix[rid] = found
        del self._lookups[rid]
        return found

    def _handed_over(self, request: KVRequest, hashes: list[bytes]) -> int | None:
        """Blocks a prefill pod says it saved for this prompt, when its hashes, model and pool
        agree with ours (None: look them up instead). A load that then misses is recomputed."""
        params = request.kv_transfer_params or {}
        remote = params.get("block_hashes")
        if not params.get("do_remote_prefill") or not remote or not hashes:
            return None
        theirs = (params.get("fingerprint"), params.get("pool"))
        if theirs[0] not in (None, self.layout.fingerprint) or theirs[1] not in (
            None,
            self.config.pool,
        ):
            self._warn_once(
                f"kv_transfer_params name model {theirs[0]} in pool {theirs[1]}, not ours"
            )
            return None
        agree = 0
        for mine, their_hash in zip(hashes, remote, strict=False):
            if mine.hex() != their_hash:
                break
            agree += 1
        if agree == 0:
            self._warn_once(
                "kv_transfer_params.block_hashes disagree with this pod's: do all pods of the "
                "pool share --hash-seed and --prefix-caching-hash-algo?"
            )
        return agree or None

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("%s; looking the prompt up instead", message)

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        bs = self.layout.block_size
        first = request.num_computed_tokens // bs
        last = first + num_external_tokens // bs
        self._queued_loads.append(
            BlockTransfer(
                request.request_id, block_ids[first:last], request.block_hashes[first:last]
            )
        )

    def build_connector_meta(self, scheduled: list[ScheduledRequest]) -> KVConnectorMetadata:
        saves = []
        if self.config.is_producer:
            saves = [t for t in map(self._plan_save, scheduled) if t is not None]
        meta = KVConnectorMetadata(self._queued_loads, saves)
        self._queued_loads = []
        return meta

    def _plan_save(self, item: ScheduledRequest) -> BlockTransfer | None:
        """The prompt blocks that become full in this step and were never saved."""
        request, block_ids, computed = item
        rid = request.request_id
        num_full = min(computed, request.num_prompt_tokens) // self.layout.block_size
        num_full = min(num_full, len(request.block_hashes), len(block_ids))
        start = self._saved_upto.get(rid, self._known_prefix.get(rid, 0))
        if num_full <= start:
            return None
        self._saved_upto[rid] = num_full
        self._has_saves.add(rid)
        self._plan_store_events(request, start, num_full)
        return BlockTransfer(rid, block_ids[start:num_full], request.block_hashes[start:num_full])

    def _plan_store_events(self, request: KVRequest, start: int, end: int) -> None:
        tokens = getattr(request, "all_token_ids", None)
        if tokens is None or getattr(request, "mm_spans", None):
            return  # no tokens to name the blocks by; image blocks are not indexed anyway
        salt = getattr(request, "cache_salt", None)
        bs = self.layout.block_size
        # a salted request's events name blocks by router key, never by tokens and salt
        keys = extend_keys([], tokens, bs, end, None, salt) if salt else None
        for i in range(start, end):
            parent = request.block_hashes[i - 1] if i else None
            self._save_plans[request.block_hashes[i]] = (
                (parent, [], [keys[i]])
                if keys is not None
                else (parent, list(tokens[i * bs : (i + 1) * bs]), None)
            )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._events += self._store_events(output.saved, output.missed)

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events

    def _store_events(self, saved: list[tuple[bytes, bool]], missed: list[bytes]) -> list:
        """KV events (``medium="STORE"``) for blocks the worker side saved to the store, and
        for blocks a load found gone from it; forgets the plans of the saves."""
        events: list = []
        for block_hash, ok in saved:
            plan = self._save_plans.pop(block_hash, None)
            if plan is None or not ok:
                continue
            parent, tokens, router_keys = plan
            events.append(
                BlockStored(
                    block_hashes=[hash_to_int(block_hash)],
                    parent_block_hash=None if parent is None else hash_to_int(parent),
                    token_ids=tokens,
                    block_size=self.layout.block_size,
                    lora_id=None,
                    medium=STORE_MEDIUM,
                    lora_name=None,
                    extra_keys=None if router_keys is not None else [None],
                    router_keys=router_keys,
                )
            )
        events += [BlockRemoved([hash_to_int(h)], STORE_MEDIUM) for h in missed]
        return events

    def step_failed(self, metadata: KVConnectorMetadata) -> None:
        for t in metadata.saves:
            for block_hash in t.block_hashes:
                self._save_plans.pop(block_hash, None)
            if t.req_id in self._saved_upto:
                self._saved_upto[t.req_id] -= len(t.block_hashes)

    def request_finished(
        self, request: KVRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        delay_free = rid in self._has_saves
        self._has_saves.discard(rid)
        self._saved_upto.pop(rid, None)
        self._known_prefix.pop(rid, None)
        self._lookups.pop(rid, None)
        wants = (request.kv_transfer_params or {}).get("do_remote_decode")
        if not (self.config.is_producer and wants):
            return delay_free, None
        n = min(request.num_prompt_tokens // self.layout.block_size, len(request.block_hashes))
        return delay_free, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "block_hashes": [h.hex() for h in request.block_hashes[:n]],
            "num_tokens": n * self.layout.block_size,
            "pool": self.config.pool,
            "fingerprint": self.layout.fingerprint,
            "kv_connector": self.config.kv_connector,
        }

    # --- worker side ----------------------------------------------------------------
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

    def take_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = super().take_output(finished_req_ids)
        # after get_finished: every save of a request it reports done is in ``saved`` too
        out.saved, out.missed = self._take_transfer_results()
        return out

    def _take_transfer_results(self) -> tuple[list[tuple[bytes, bool]], list[bytes]]:
        """``(hash, stored?)`` of saves finished and hashes loads missed since the last call."""
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

    def stats(self) -> KVConnectorStats:
        s = self.kv_io.stats
        return KVConnectorStats(s.saved, s.save_failures, s.loaded, s.misses, s.rejected)

    def rejections(self) -> dict[str, int]:
        return rejection_counts(self.kv_io, self.store)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def close(self) -> None:
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=True, cancel_futures=True)
        for worker in (self._loader, self._writer):
            if worker is not None:
                worker.close(close_store=False)
        self.store.close()


def _result(job: Future, what: str):
    try:
        return job.result()
    except Exception:  # a bug, not a backend fault (stores never raise on those)
        logger.exception("KV block %s failed", what)
        return None


class RedisConnector(StorageConnector):
    """Blocks in Redis: ``kv_connector_extra_config = {"url": "redis://host:6379/0", ...}``."""

    backend_key = "url"


class SharedStorageConnector(StorageConnector):
    """Blocks as files on a shared volume: ``kv_connector_extra_config = {"path": "/cache/kv"}``."""

    backend_key = "path"
