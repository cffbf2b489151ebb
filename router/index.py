"""PrefixIndex: which pod holds which block, keyed by the router's chained keys.

Each ``BlockStored`` is turned into router keys from its parent's key and its tokens
(see :mod:`epdserve.router.keys`; a prompt's first block is rooted by its ``cache_salt``);
the index remembers, per pod, engine hash -> key so ``BlockRemoved`` can evict and children
can chain. Memory is bounded: at most
``capacity`` keys, least recently stored or matched first out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from epdserve.connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from epdserve.router.keys import chain_keys, first_block_salt, root_key, token_bytes


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
        self._entries: OrderedDict[int, dict[str, int]] = OrderedDict()  # key -> pod -> hash
        self._pods: dict[str, _PodBlocks] = {}
        self._lock = threading.Lock()
        self.evicted = 0  # keys dropped by the capacity bound

    def __len__(self) -> int:
        return len(self._entries)

    def pods(self) -> list[str]:
        """Pods that have sent at least one event (or were added)."""
        with self._lock:
            return list(self._pods)

    def block_size(self, pod: str) -> int:
        """The pod's block size as announced by its events (0 if unknown)."""
        blocks = self._pods.get(pod)
        return blocks.block_size if blocks else 0

    # --- ingest --------------------------------------------------------------------------

    def apply(self, pod: str, batch: EventBatch) -> IngestResult:
        """Apply one batch of a pod's events, in order."""
        result = IngestResult()
        with self._lock:
            blocks = self._pods.setdefault(pod, _PodBlocks())
            for event in batch.events:
                if getattr(event, "group_idx", None):
                    continue  # a hybrid model's sliding-window groups: group 0 names prefixes
                if isinstance(event, BlockStored):
                    self._store(pod, blocks, event, result)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        result.removed += self._remove(pod, blocks, h)
                elif isinstance(event, AllBlocksCleared):
                    self._drop_pod(pod, blocks)
                    result.cleared = True
            self._enforce_capacity()
        return result

    def _store(
        self, pod: str, blocks: _PodBlocks, event: BlockStored, result: IngestResult
    ) -> None:
        extra = event.extra_keys
        if event.parent_block_hash is None:
            salt = first_block_salt(extra[0]) if extra else None
            parent = root_key(event.lora_name, salt)
            if salt is not None:
                extra = [None, *extra[1:]]  # the salt is in the root key now
        else:
            known = blocks.by_hash.get(event.parent_block_hash)
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
            self._add(pod, blocks, h, key)
        result.stored += n
        if event.parent_block_hash is None and keys:
            result.roots.append((keys[0], event.block_hashes[0]))  # for the seed check

    def _add(self, pod: str, blocks: _PodBlocks, engine_hash: int, key: int) -> None:
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

    def _remove(self, pod: str, blocks: _PodBlocks, engine_hash: int) -> int:
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

    def _drop_pod(self, pod: str, blocks: _PodBlocks) -> None:
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
            blocks = self._pods.pop(pod, None)
            if blocks is not None:
                self._drop_pod(pod, blocks)

    def clear_pod(self, pod: str) -> None:
        """Drop a pod's blocks but keep it known (a resync follows)."""
        with self._lock:
            blocks = self._pods.get(pod)
            if blocks is not None:
                self._drop_pod(pod, blocks)

    # --- lookup --------------------------------------------------------------------------

    def match(self, keys: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        """Per pod, how many of ``keys`` (from the first on) it holds consecutively."""
        result = {pod: 0 for pod in pods}
        active = set(result)
        with self._lock:
            for depth, key in enumerate(keys, start=1):
                entry = self._entries.get(key)
                if entry is None:
                    break
                active.intersection_update(entry)
                if not active:
                    break
                self._entries.move_to_end(key)
                for pod in active:
                    result[pod] = depth
        return result

    def pod_block_count(self, pod: str) -> int:
        """How many blocks the index holds for ``pod``."""
        blocks = self._pods.get(pod)
        return len(blocks.by_hash) if blocks else 0

    def check_integrity(self) -> None:
        """Assert that the key map and the per-pod maps agree (tests)."""
        with self._lock:
            for key, entry in self._entries.items():
                for pod, h in entry.items():
                    assert self._pods[pod].by_hash[h][0] == key, (pod, h, key)
            for pod, blocks in self._pods.items():
                for h, (key, count) in blocks.by_hash.items():
                    assert count >= 1 and self._entries[key].get(pod) == h, (pod, h, key)
