"""Allocates KV blocks to requests and finds prefix-cache hits (vLLM v1 semantics).

One full-attention group today; ``KVCacheCoordinator``-style multi-group support (sliding
window for Gemma3) slots in behind the same four methods.
"""

from __future__ import annotations

from epdserve.engine.core.block_pool import BlockPool, KVCacheBlock
from epdserve.engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """``get_computed_blocks`` / ``allocate_slots`` / ``free`` over one ``BlockPool``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_events: bool = False,
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_events)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of whole blocks; never the prompt's last token."""
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        # the last token must be computed to produce logits
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_cache: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; None (nothing changed) if it can't.

        ``delay_cache``: the new blocks are still being filled (a KV connector's load), so
        they are not named in the prefix cache until ``cache_blocks`` says they are valid."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # hit blocks sitting in the free queue stop being evictable once touched
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) > self.pool.get_num_free_blocks() - num_evictable_hits:
            if not blocks:
                self.req_blocks.pop(request.request_id)
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            # cache hits are already named: events for later blocks chain from the last hit
            rid = request.request_id
            self.num_cached_blocks[rid] = max(self.num_cached_blocks.get(rid, 0), len(blocks))
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)
        if not delay_cache:
            self._cache_blocks(request, blocks, total)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Name the request's full blocks up to ``num_tokens`` in the prefix cache."""
        self._cache_blocks(request, self.req_blocks.get(request.request_id, []), num_tokens)

    def has_blocks(self, request_id: str) -> bool:
        return bool(self.req_blocks.get(request_id))

    def _cache_blocks(self, request: Request, blocks: list[KVCacheBlock], total: int) -> None:
        if not self.enable_caching:
            return
        num_known = min(total, request.num_tokens) // self.block_size
        num_full = min(num_known, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            self.pool.cache_full_blocks(
                blocks,
                request.block_hashes,
                num_cached,
                num_full,
                request.all_token_ids,
                self.block_size,
            )
            self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so its prefix outlives its suffix."""
        self.release(self.detach(request))

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """Take a request's blocks away from it, still referenced (a connector is using them)."""
        self.num_cached_blocks.pop(request.request_id, None)
        return self.req_blocks.pop(request.request_id, [])

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop the references ``detach`` kept, tail first."""
        self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def take_events(self) -> list:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()
