"""Allocates KV blocks to requests and finds prefix-cache hits (vLLM v1 semantics).

Blocks are kept per KV-cache group (``kv_cache_groups``): one group for most models, a
full-attention group plus sliding-window groups for hybrid ones (Gemma3). Block lists
cross this API as one list per group; ``get_block_ids`` is group 0's.
"""

from __future__ import annotations

from epdserve.connectors.kv_events.keys import extend_keys
from epdserve.engine.core.block_pool import BlockPool, KVCacheBlock
from epdserve.engine.core.kv_cache_groups import (
    FullAttentionManager,
    KVCacheSpec,
    SlidingWindowManager,
    cdiv,
    make_managers,
)
from epdserve.engine.core.request import Request

GroupBlocks = tuple[list[KVCacheBlock], ...]  # one list per KV-cache group


class KVCacheManager:
    """``get_computed_blocks`` / ``allocate_slots`` / ``free`` over one shared ``BlockPool``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_events: bool = False,
        spec: KVCacheSpec | None = None,
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_events)
        if spec is None:  # one full-attention group
            self.managers = [FullAttentionManager(self.pool, block_size, 0)]
        else:
            self.managers = make_managers(spec, self.pool, block_size)
        self.num_groups = len(self.managers)
        self.sliding = [m for m in self.managers if isinstance(m, SlidingWindowManager)]
        # what ``allocate_slots`` returns when the request's blocks already hold its tokens
        # (most decode steps): one shared, immutable value
        self.no_new_blocks: GroupBlocks = tuple(() for _ in self.managers)
        self.req_blocks: dict[str, GroupBlocks] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.salted_keys: dict[str, list[int]] = {}  # request -> router keys of its blocks
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix of whole blocks every group can use; never the prompt's
        last token (it must be computed to produce logits)."""
        empty = tuple([] for _ in self.managers)
        if not self.enable_caching or request.skip_prefix_cache:
            return empty, 0
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        hits = empty
        n = len(hashes)
        while n > 0:  # shrink until every group agrees on the same length
            hits = tuple(m.find_longest_cache_hit(hashes[:n]) for m in self.managers)
            agreed = min(len(h) for h in hits)
            if agreed == n:
                break
            n = agreed
        if n == 0:
            hits = empty
        self.prefix_queries += request.num_tokens
        self.prefix_hits += n * self.block_size
        return hits, n * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        delay_cache: bool = False,
    ) -> GroupBlocks | None:
        """Make room for ``num_new_tokens`` more tokens; the new blocks per group, or None
        (nothing allocated) if they don't fit; ``no_new_blocks`` when none were needed.

        ``delay_cache``: the new blocks are still being filled (a KV connector's load), so
        they are not named in the prefix cache until ``cache_blocks`` says they are valid."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if blocks is not None and not self.sliding and new_computed_blocks is None:
            if total <= len(blocks[0]) * self.block_size:  # decode inside its last block
                if self.enable_caching and not delay_cache:
                    known = len(request.all_token_ids)
                    full = (total if total < known else known) // self.block_size
                    if full > self.num_cached_blocks.get(rid, 0):
                        self._cache_blocks(request, blocks, total)
                return self.no_new_blocks
        if blocks is None:
            blocks = tuple([[] for _ in self.managers])
        else:  # blocks out of every future query's window go back first (sliding groups)
            for manager in self.sliding:
                manager.remove_skipped_blocks(
                    blocks[manager.group_idx], request.num_computed_tokens
                )
        want = cdiv(total, self.block_size)
        hits = new_computed_blocks if new_computed_blocks and any(new_computed_blocks) else None
        if hits is None:
            needs = [max(want - len(b), 0) for b in blocks]
            evictable = 0
        else:
            needs = [max(want - len(b) - len(h), 0) for b, h in zip(blocks, hits, strict=True)]
            # hit blocks sitting in the free queue stop being evictable once touched
            evictable = sum(1 for h in hits for b in h if b.ref_cnt == 0 and not b.is_null)
        if sum(needs) > self.pool.get_num_free_blocks() - evictable:
            return None
        self.req_blocks[rid] = blocks
        if hits is not None:
            for group_blocks, group_hits in zip(blocks, hits, strict=True):
                self.pool.touch(group_hits)
                group_blocks.extend(group_hits)
            # cache hits are already named: events for later blocks chain from the last hit
            self.num_cached_blocks[rid] = max(self.num_cached_blocks.get(rid, 0), len(blocks[0]))
        new = tuple([self.pool.get_new_blocks(n) if n else [] for n in needs])
        for group_blocks, group_new in zip(blocks, new, strict=True):
            if group_new:
                group_blocks.extend(group_new)
        if not delay_cache:
            self._cache_blocks(request, blocks, total)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Name the request's full blocks up to ``num_tokens`` in the prefix cache."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks:
            self._cache_blocks(request, blocks, num_tokens)

    def has_blocks(self, request_id: str) -> bool:
        return any(self.req_blocks.get(request_id, ()))

    def _cache_blocks(self, request: Request, blocks: GroupBlocks, total: int) -> None:
        if not self.enable_caching:
            return
        num_known = min(total, request.num_tokens) // self.block_size
        num_full = min(num_known, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            extra_keys = request.block_extra_keys(num_cached, num_full)
            router_keys = self._router_keys(request, num_cached, num_full)
            lora = request.lora and (
                request.lora.lora_int_id,
                request.lora.lora_name,
                request.lora.digest,
            )
            for g, group_blocks in enumerate(blocks):
                self.pool.cache_full_blocks(
                    group_blocks,
                    request.block_hashes,
                    num_cached,
                    num_full,
                    request.all_token_ids,
                    self.block_size,
                    extra_keys,
                    group_idx=g,
                    router_keys=router_keys,
                    lora=lora,
                )
            self.num_cached_blocks[request.request_id] = num_full

    def _router_keys(self, request: Request, num_cached: int, num_full: int) -> list[int] | None:
        """A salted request's router keys for blocks ``num_cached..num_full-1`` (its events
        carry these instead of tokens and salt); None when unsalted. Image blocks and the
        blocks after them get none: a router cannot name images."""
        if not self.pool.enable_events or not request.cache_salt:
            return None
        end = num_full
        if request.mm_spans:
            end = min(end, min(start for start, _, _ in request.mm_spans) // self.block_size)
        keys = self.salted_keys.setdefault(request.request_id, [])
        extend_keys(
            keys,
            request.all_token_ids,
            self.block_size,
            end,
            request.lora_name,
            request.cache_salt,
            request.lora_digest,
        )
        return keys[num_cached:end]

    def forget_uncomputed(self, request: Request, num_computed: int) -> None:
        """Un-name the request's blocks past its first ``num_computed`` tokens: a failed
        step named them in the prefix cache but may never have written their KV."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        first = num_computed // self.block_size
        self.pool.uncache([b for group in blocks for b in group[first:]])
        if self.num_cached_blocks.get(rid, 0) > first:
            self.num_cached_blocks[rid] = first

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so its prefix outlives its suffix."""
        self.release(self.detach(request))

    def detach(self, request: Request) -> GroupBlocks:
        """Take a request's blocks away from it, still referenced (a connector is using them)."""
        self.num_cached_blocks.pop(request.request_id, None)
        self.salted_keys.pop(request.request_id, None)
        return self.req_blocks.pop(request.request_id, ())

    def release(self, blocks: GroupBlocks) -> None:
        """Drop the references ``detach`` kept, tail first across groups (they grow in
        lockstep), so prefixes outlive suffixes."""
        if blocks:
            tail_first = range(len(blocks[0]) - 1, -1, -1)
            self.pool.free_blocks([g[i] for i in tail_first for g in blocks])

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids (what KV connectors move)."""
        blocks = self.req_blocks.get(request_id)
        return [b.block_id for b in blocks[0]] if blocks else []

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        blocks = self.req_blocks.get(request_id) or tuple([] for _ in self.managers)
        return [[b.block_id for b in g] for g in blocks]

    def take_events(self) -> list:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()
