"""PrefixIndex: which pod holds which block, keyed by the router's chained keys.

Each ``BlockStored`` is turned into router keys from its parent's key and its tokens
(see :mod:`epdserve.router.keys`; a prompt's first block is rooted by its ``cache_salt``);
a salted request's blocks come with their keys already (``router_keys``: the engine
computed them, and sent neither tokens nor salt). The index remembers, per pod, engine
hash -> key so ``BlockRemoved`` can evict and children can chain. Memory is bounded: at most
``capacity`` keys, least recently stored or matched first out.

Two tiers, told apart by the events' ``medium``: ``local`` (the pod's own device or host
cache; vLLM's "GPU"/"CPU") and ``store`` (``medium == "STORE"``: blocks the pod saved to the
pool's shared store, which every pod of the pool can load).

An adapter's blocks are rooted by its name and, from our pods, the digest of its files
(``lora_digest``, see :mod:`.adapter_versions`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from epdserve.connectors.kv_events import (
    STORE_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from epdserve.router.adapter_versions import AdapterVersions
from epdserve.router.keys import chain_keys, first_block_salt, root_key, token_bytes, without_lora

LOCAL, STORE = "local", "store"
TIERS = (LOCAL, STORE)


def tier_of(medium: str | None) -> str:
    """The index tier of an event's ``medium``."""
    return STORE if medium == STORE_MEDIUM else LOCAL


@dataclass
class IngestResult:
    """What applying one batch did, for metrics."""

    stored: int = 0
    removed: int = 0
    orphaned: int = 0  # blocks whose parent the index does not know
    skipped: int = 0  # blocks with image extra keys or invalid tokens
    cleared: bool = False
    roots: list[tuple[int, int]] = field(default_factory=list)  # first blocks: (key, hash)


class _PodBlocks:
    """One pod's engine hash -> [router key, refcount], plus its block size."""

    __slots__ = ("by_hash", "block_size")

    def __init__(self) -> None:
        self.by_hash: dict[int, list[int]] = {}
        self.block_size = 0


class PrefixIndex:
    """Thread-safe prefix index over every pod's cached blocks."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        if capacity < 1:
            raise ValueError("index capacity must be >= 1")
        self.capacity = capacity
        # key -> (pod, tier) -> engine hash
        self._entries: OrderedDict[int, dict[tuple[str, str], int]] = OrderedDict()
        self._pods: dict[tuple[str, str], _PodBlocks] = {}  # (pod, tier) -> its blocks
        self.versions = AdapterVersions()  # each pod's adapters' digests
        self._lock = threading.Lock()
        self.evicted = 0  # keys dropped by the capacity bound

    def __len__(self) -> int:
        return len(self._entries)

    def pods(self) -> list[str]:
        """Pods that have sent at least one event (or were added)."""
        with self._lock:
            return list(dict.fromkeys(pod for pod, _ in self._pods))

    def block_size(self, pod: str) -> int:
        """The pod's block size as announced by its events (0 if unknown)."""
        sizes = [b.block_size for t in TIERS if (b := self._pods.get((pod, t))) is not None]
        return max(sizes, default=0)

    def lora_digest(self, pod: str, lora_name: str) -> str | None:
        """The digest of adapter ``lora_name``'s files in ``pod``'s latest stored blocks (None:
        a vLLM pod, or none stored yet): a request for it at that pod is keyed with it."""
        return self.versions.get(pod, lora_name)

    # --- ingest --------------------------------------------------------------------------

    def apply(self, pod: str, batch: EventBatch) -> IngestResult:
        """Apply one batch of a pod's events, in order."""
        result = IngestResult()
        with self._lock:
            self._pods.setdefault((pod, LOCAL), _PodBlocks())
            for event in batch.events:
                if getattr(event, "group_idx", None):
                    continue  # a hybrid model's sliding-window groups: group 0 names prefixes
                if isinstance(event, AllBlocksCleared):  # the pod's own cache; the store stays
                    self._drop_pod((pod, LOCAL), self._pods[(pod, LOCAL)])
                    result.cleared = True
                    continue
                owner = (pod, tier_of(event.medium))
                blocks = self._pods.setdefault(owner, _PodBlocks())
                if isinstance(event, BlockStored):
                    self.versions.note(pod, event.lora_name, event.lora_digest)
                    self._store(owner, blocks, event, result)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        result.removed += self._remove(owner, blocks, h)
            self._enforce_capacity()
        return result

    def _store(
        self, owner: tuple[str, str], blocks: _PodBlocks, event: BlockStored, result: IngestResult
    ) -> None:
        if event.router_keys is not None:
            self._store_keyed(owner, blocks, event, result)
            return
        extra = without_lora(event.extra_keys, event.lora_name)  # the name is in the root
        if event.parent_block_hash is None:
            salt = first_block_salt(extra[0]) if extra else None
            parent = root_key(event.lora_name, salt, event.lora_digest)
            if salt is not None:
                extra = [None, *extra[1:]]  # the salt is in the root key now
        else:
            known = self._parent(owner[0], blocks, event.parent_block_hash)
            if known is None:
                result.orphaned += len(event.block_hashes)
                return
            parent = known[0]
        n = len(event.block_hashes)
        if extra is not None and any(k is not None for k in extra):
            n = next(i for i, k in enumerate(extra) if k is not None)  # stop at an image block
        try:
            packed = token_bytes(event.token_ids[: n * event.block_size])
        except (OverflowError, TypeError):
            result.skipped += len(event.block_hashes)
            return
        result.skipped += len(event.block_hashes) - n
        blocks.block_size = event.block_size
        keys = chain_keys(parent, packed, event.block_size, n)
        for h, key in zip(event.block_hashes, keys, strict=False):
            self._add(owner, blocks, h, key)
        result.stored += n
        if event.parent_block_hash is None and keys:
            result.roots.append((keys[0], event.block_hashes[0]))  # for the seed check

    def _store_keyed(
        self, owner: tuple[str, str], blocks: _PodBlocks, event: BlockStored, result: IngestResult
    ) -> None:
        """A salted request's blocks: the leading ones carry their key (no chaining needed)."""
        n = min(len(event.router_keys), len(event.block_hashes))
        blocks.block_size = event.block_size
        for h, key in zip(event.block_hashes[:n], event.router_keys[:n], strict=True):
            self._add(owner, blocks, h, key)
        result.stored += n
        result.skipped += len(event.block_hashes) - n

    def _parent(self, pod: str, blocks: _PodBlocks, engine_hash: int) -> list[int] | None:
        """The parent's key: a pod names a block by one engine hash in every tier."""
        known = blocks.by_hash.get(engine_hash)
        for tier in TIERS:
            other = self._pods.get((pod, tier))
            if known is None and other is not None:
                known = other.by_hash.get(engine_hash)
        return known

    def _add(self, pod: tuple[str, str], blocks: _PodBlocks, engine_hash: int, key: int) -> None:
        slot = blocks.by_hash.get(engine_hash)
        if slot is not None and slot[0] == key:
            slot[1] += 1
        else:
            blocks.by_hash[engine_hash] = [key, 1]
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = {pod: engine_hash}
        else:
            entry[pod] = engine_hash
            self._entries.move_to_end(key)

    def _remove(self, pod: tuple[str, str], blocks: _PodBlocks, engine_hash: int) -> int:
        slot = blocks.by_hash.get(engine_hash)
        if slot is None:
            return 0
        slot[1] -= 1
        if slot[1] > 0:
            return 0
        del blocks.by_hash[engine_hash]
        entry = self._entries.get(slot[0])
        if entry is not None and entry.get(pod) == engine_hash:
            del entry[pod]
            if not entry:
                del self._entries[slot[0]]
        return 1

    def _enforce_capacity(self) -> None:
        while len(self._entries) > self.capacity:
            _, entry = self._entries.popitem(last=False)
            for pod, engine_hash in entry.items():
                self._pods[pod].by_hash.pop(engine_hash, None)
            self.evicted += 1

    def _drop_pod(self, pod: tuple[str, str], blocks: _PodBlocks) -> None:
        for key, _ in blocks.by_hash.values():
            entry = self._entries.get(key)
            if entry is not None:
                entry.pop(pod, None)
                if not entry:
                    del self._entries[key]
        blocks.by_hash.clear()

    def remove_pod(self, pod: str) -> None:
        """Forget a pod and every block it held."""
        with self._lock:
            self.versions.forget(pod)
            for tier in TIERS:
                blocks = self._pods.pop((pod, tier), None)
                if blocks is not None:
                    self._drop_pod((pod, tier), blocks)

    def clear_pod(self, pod: str) -> None:
        """Drop a pod's blocks, both tiers, but keep it known (a resync follows)."""
        with self._lock:
            for tier in TIERS:
                blocks = self._pods.get((pod, tier))
                if blocks is not None:
                    self._drop_pod((pod, tier), blocks)

    # --- lookup --------------------------------------------------------------------------

    def match(self, keys: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        """Per pod, how many of ``keys`` (from the first on) its own cache holds
        consecutively."""
        return {pod: local for pod, (local, _) in self.match_tiers(keys, pods).items()}

    def match_tiers(self, keys: Sequence[int], pods: Iterable[str]) -> dict[str, tuple[int, int]]:
        """Per pod, ``(local, loadable)``: the consecutive prefix its own cache holds, and the
        consecutive prefix it holds or can load from the shared store (``loadable >= local``;
        a store block counts for every pod, whichever pod saved it)."""
        result = {pod: (0, 0) for pod in pods}
        local = set(result)
        with self._lock:
            for depth, key in enumerate(keys, start=1):
                entry = self._entries.get(key)
                if entry is None:
                    break
                local &= {pod for pod, tier in entry if tier == LOCAL}
                in_store = any(tier == STORE for _, tier in entry)
                if not local and not in_store:
                    break
                self._entries.move_to_end(key)
                for pod, (hit, loadable) in result.items():
                    if loadable == depth - 1 and (in_store or pod in local):
                        result[pod] = (depth if pod in local else hit, depth)
        return result

    def pod_block_count(self, pod: str, tier: str = LOCAL) -> int:
        """How many blocks the index holds for ``pod`` in ``tier``."""
        blocks = self._pods.get((pod, tier))
        return len(blocks.by_hash) if blocks else 0

    def tier_block_counts(self) -> dict[str, int]:
        """Blocks held per tier, summed over pods (the ``index_blocks{tier}`` gauge)."""
        with self._lock:
            counts = dict.fromkeys(TIERS, 0)
            for (_, tier), blocks in self._pods.items():
                counts[tier] += len(blocks.by_hash)
            return counts

    def check_integrity(self) -> None:
        """Assert that the key map and the per-pod maps agree (tests)."""
        with self._lock:
            for key, entry in self._entries.items():
                for pod, h in entry.items():
                    assert self._pods[pod].by_hash[h][0] == key, (pod, h, key)
            for pod, blocks in self._pods.items():
                for h, (key, count) in blocks.by_hash.items():
                    assert count >= 1 and self._entries[key].get(pod) == h, (pod, h, key)
