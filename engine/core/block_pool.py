"""Physical KV blocks: ref counts, an O(1) LRU free queue, and the prefix-cache map."""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.engine.core.hashing import BlockHash


class KVCacheBlock:
    """One block of KV memory; ``block_hash`` is set once the block is full and cached."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "group_idx",
        "prev_free",
        "next_free",
        "is_null",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_idx = 0  # the KV-cache group whose prefix cache names this block
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list with sentinels: evict from the front, free to the back, O(1) removal."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def block_ids(self) -> list[int]:
        out, node = [], self.head.next_free
        while node is not self.tail:
            out.append(node.block_id)
            node = node.next_free
        return out


@dataclass
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    extra_keys: list = field(default_factory=list)
    group_idx: int = 0
    # a salted request's blocks: the router's keys instead of tokens and extra keys
    router_keys: list[int] | None = None
    lora_id: int | None = None  # the adapter's pod-local id (None: the base model)
    lora_name: str | None = None
    lora_digest: str | None = None  # the adapter's files (ours; vLLM has no such field)


@dataclass
class BlockRemoved:
    block_hashes: list[BlockHash]
    group_idx: int = 0


@dataclass
class AllBlocksCleared:
    pass


def cache_key(block_hash: BlockHash, group_idx: int):
    """Prefix-cache key: the same tokens are cached separately per KV-cache group."""
    return block_hash if group_idx == 0 else (group_idx, block_hash)


class BlockPool:
    """Owns every block; block 0 is the null block and is never handed out. Shared by all
    KV-cache groups: a block serves one group at a time."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = False):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks: need at least 2 (one is the null block), got {num_blocks}"
            )
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        # cache_key -> {block_id: block}; no dedup: identical content may live in several blocks
        self.cached: dict = {}
        self.events: list = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of usable blocks (null block excluded) that are in use."""
        total = self.num_blocks - 1
        return 1.0 - self.free_queue.num_free / total

    def get_cached_block(self, block_hash: BlockHash, group_idx: int = 0) -> KVCacheBlock | None:
        entry = self.cached.get(cache_key(block_hash, group_idx))
        return next(iter(entry.values())) if entry else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the LRU front, evicting their cached content lazily."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot get {n} blocks: only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        key = cache_key(block.block_hash, block.group_idx)
        entry = self.cached.get(key)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached[key]
        if self.enable_events:
            self.events.append(BlockRemoved([block.block_hash], block.group_idx))
        block.block_hash = None

    def uncache(self, blocks: list[KVCacheBlock]) -> None:
        """Forget the cached names of ``blocks`` (announced as removed); they stay in use."""
        for block in blocks:
            self._evict(block)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: list[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the queue in the given order."""
        for block in ordered:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached: int,
        num_full: int,
        token_ids,
        block_size: int,
        extra_keys: list | None = None,
        group_idx: int = 0,
        router_keys: list[int] | None = None,
        lora: tuple[int, str, str | None] | None = None,
    ) -> None:
        """Name blocks ``num_cached..num_full-1`` of one group by their hashes and announce
        them (null blocks of a sliding window are skipped); ``extra_keys``, one entry per
        block of that range, are the hash extra keys the events carry (None: none).
        ``router_keys`` (a salted request's; one per leading block of the range, maybe
        fewer) make the event carry those keys instead of the tokens and extra keys;
        ``lora`` (id, name, digest) names the adapter the blocks were computed with."""
        if not self.enable_caching or num_full <= num_cached:
            return
        new_hashes, new_extra, new_keys = [], [], []
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            if router_keys is not None and i - num_cached < len(router_keys):
                new_keys.append(router_keys[i - num_cached])
            new_extra.append(extra_keys[i - num_cached] if extra_keys else None)
            block.block_hash = block_hashes[i]
            block.group_idx = group_idx
            self.cached.setdefault(cache_key(block.block_hash, group_idx), {})[block.block_id] = (
                block
            )
            new_hashes.append(block.block_hash)
        if self.enable_events and new_hashes:
            parent = block_hashes[num_cached - 1] if num_cached > 0 else None
            if router_keys is not None:  # salted: neither tokens nor the salt leave the pod
                event = BlockStored(new_hashes, parent, [], block_size, [], group_idx, new_keys)
            else:
                tokens = list(token_ids[num_cached * block_size : num_full * block_size])
                event = BlockStored(new_hashes, parent, tokens, block_size, new_extra, group_idx)
            if lora is not None:
                event.lora_id, event.lora_name, event.lora_digest = lora
            self.events.append(event)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def check_integrity(self) -> None:
        """Assert the queue, ref counts and cache map agree (used by tests)."""
        free_ids = self.free_queue.block_ids()
        assert len(free_ids) == self.free_queue.num_free
        assert set(free_ids) == {b.block_id for b in self.blocks[1:] if b.ref_cnt == 0}
        for key, entry in self.cached.items():
            for block in entry.values():
                assert cache_key(block.block_hash, block.group_idx) == key
