"""The scheduler side of a storage connector: what to load from the store, what to save.

It looks up how many leading prompt blocks the store holds (or trusts the hashes a prefill
pod handed over), queues loads into freshly allocated blocks, asks for each block to be
saved once, right after the forward that fills it, and turns what the worker side reports
stored (or found gone) into store-tier KV events. A prefill pod also saves a prompt's partial
last block (its tail, ``load_chain.py``) and names it in ``kv_transfer_params``, so the decode
pod loads every prompt token but the last.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from epdserve.connectors.kv_connector.base import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLayout,
    KVRequest,
    ScheduledRequest,
)
from epdserve.connectors.kv_connector.config import KVTransferConfig
from epdserve.connectors.kv_connector.load_chain import (
    LoadChain,
    chain_tokens,
    load_chain,
    tail_hash,
)
from epdserve.connectors.kv_connector.store_lookup import Found, handed_over, look_up
from epdserve.connectors.kv_events import STORE_MEDIUM, BlockRemoved, BlockStored, hash_to_int
from epdserve.connectors.kv_events.keys import extend_keys
from epdserve.connectors.storage import KVBlockIO

logger = logging.getLogger(__name__)

LOOKUP_WAIT_S = 0.005  # a healthy store answers within this; a slower one is asked again later


class StoreScheduler:
    """``StorageConnector``'s scheduler-side methods (see ``KVConnectorBase``) and state."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv_io: KVBlockIO):
        self.config, self.layout, self.kv_io = config, layout, kv_io
        self._warned = False
        self._known_prefix: dict[str, Found] = {}  # req -> what of its chain the store holds
        self._chains: dict[str, LoadChain] = {}  # req -> what it may load
        self._lookups: dict[str, Future] = {}  # req -> store lookup in flight
        self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="epd-kv-lookup")
        self._saved_upto: dict[str, int] = {}  # req -> blocks saved (or skipped) so far
        self._has_saves: set[str] = set()
        self._tails: dict[str, bytes] = {}  # req -> its prompt's tail, saved or being saved
        self._queued_loads: list[BlockTransfer] = []
        # block hash -> (parent hash, tokens, router keys, adapter) of planned saves, for
        # store events
        self._save_plans: dict[bytes, tuple[bytes | None, list[int], Any, Any]] = {}
        self._events: list = []  # store-tier KV events not yet taken

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        known = self._known(request)
        if known is None:
            return None, False
        if not self.config.is_consumer:
            return 0, False
        tokens = chain_tokens(self._chain(request), known.count, self.layout.block_size)
        n = max(0, tokens - num_computed_tokens)
        return n, n > 0

    def _chain(self, request: KVRequest) -> LoadChain:
        """What ``request`` may load: its prompt's tail too when it is a consumer's request
        that has no outputs yet."""
        rid = request.request_id
        chain = self._chains.get(rid)
        if chain is None:
            bs, tail = self.layout.block_size, None
            if self.config.is_consumer and request.num_tokens == request.num_prompt_tokens:
                tail = tail_hash(request, bs)
            chain = self._chains[rid] = load_chain(request, bs, tail)
        return chain

    def _known(self, request: KVRequest) -> Found | None:
        """What of the request's chain the store holds (the prompt's last token is never
        loaded: it must be computed); None while the store has not answered, so a slow store
        never stalls the engine."""
        rid = request.request_id
        if rid in self._known_prefix:
            return self._known_prefix[rid]
        job = self._lookups.get(rid)
        if job is None:
            chain, heads = self._chain(request), self.layout.num_kv_heads
            params = request.kv_transfer_params or {}
            layout = (self.layout.fingerprint, self.config.pool)
            trusted, why = handed_over(params, chain.hashes, chain.tail_tokens > 0, *layout)
            if why is not None:
                self._warn_once(why)
            if trusted is not None and heads % (trusted.part_heads or 1) == 0:
                self._known_prefix[rid] = trusted
                return trusted
            if not chain.hashes:
                self._known_prefix[rid] = Found(0, 0)
                return self._known_prefix[rid]
            own = self.layout.value_heads or heads
            job = self._lookup_pool.submit(look_up, self.kv_io, chain.hashes, own)
            self._lookups[rid] = job
        try:
            found = job.result(timeout=LOOKUP_WAIT_S)
        except TimeoutError:
            return None
        self._known_prefix[rid] = found
        del self._lookups[rid]
        return found

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("%s; looking the prompt up instead", message)

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        bs, chain = self.layout.block_size, self._chain(request)
        first = request.num_computed_tokens // bs
        last = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        tail = chain.tail_tokens if chain.tail_tokens and last == len(chain.hashes) else 0
        ids, hashes = block_ids[first:last], chain.hashes[first:last]
        part_heads = self._known_prefix.get(request.request_id, Found(0, 0)).part_heads
        if part_heads == (self.layout.value_heads or self.layout.num_kv_heads):
            part_heads = 0  # cut as this pod cuts them
        self._queued_loads.append(BlockTransfer(request.request_id, ids, hashes, tail, part_heads))

    def build_connector_meta(self, scheduled: list[ScheduledRequest]) -> KVConnectorMetadata:
        saves = []
        if self.config.is_producer:
            saves = [t for t in map(self._plan_save, scheduled) if t is not None]
        meta = KVConnectorMetadata(self._queued_loads, saves)
        self._queued_loads = []
        return meta

    def _plan_save(self, item: ScheduledRequest) -> BlockTransfer | None:
        """The prompt blocks that become full in this step and were never saved, and, once
        the prompt is computed, the tail of a prompt handed over to a decode pod."""
        request, block_ids, computed = item
        rid = request.request_id
        num_full = min(computed, request.num_prompt_tokens) // self.layout.block_size
        num_full = min(num_full, len(request.block_hashes), len(block_ids))
        start = self._saved_upto.get(rid, self._known_prefix.get(rid, Found(0, 0)).count)
        ids, hashes = block_ids[start:num_full], request.block_hashes[start:num_full]
        tail = self._plan_tail(request, block_ids, computed)
        if not ids and tail is None:
            return None
        self._has_saves.add(rid)
        if ids:
            self._saved_upto[rid] = num_full
            self._plan_store_events(request, start, num_full)
        if tail is None:
            return BlockTransfer(rid, ids, hashes)
        k = request.num_prompt_tokens // self.layout.block_size
        rest = request.num_prompt_tokens % self.layout.block_size
        return BlockTransfer(rid, [*ids, block_ids[k]], [*hashes, tail], rest)

    def _plan_tail(self, request: KVRequest, block_ids: list[int], computed: int) -> bytes | None:
        """The tail hash of a prompt to hand over whose last token this step computes (when
        the tail holds more than that last token, which the decode pod computes anyway)."""
        rid, bs = request.request_id, self.layout.block_size
        wants = (request.kv_transfer_params or {}).get("do_remote_decode")
        if not wants or rid in self._tails or computed < request.num_prompt_tokens:
            return None
        if request.num_prompt_tokens % bs < 2:
            return None
        if len(block_ids) <= request.num_prompt_tokens // bs:
            return None
        tail = tail_hash(request, bs)
        if tail is not None:
            self._tails[rid] = tail
        return tail

    def _plan_store_events(self, request: KVRequest, start: int, end: int) -> None:
        tokens = getattr(request, "all_token_ids", None)
        if tokens is None or getattr(request, "mm_spans", None):
            return  # no tokens to name the blocks by; image blocks are not indexed anyway
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora", None)  # an adapter's blocks are named by name + digest
        name, digest = (lora.lora_name, lora.digest) if lora is not None else (None, None)
        bs = self.layout.block_size
        # a salted request's events name blocks by router key, never by tokens and salt
        keys = extend_keys([], tokens, bs, end, name, salt, digest) if salt else None
        for i in range(start, end):
            parent = request.block_hashes[i - 1] if i else None
            self._save_plans[request.block_hashes[i]] = (
                (parent, [], [keys[i]], lora)
                if keys is not None
                else (parent, list(tokens[i * bs : (i + 1) * bs]), None, lora)
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
            parent, tokens, router_keys, lora = plan
            extra = [[lora.lora_name]] if lora is not None else [None]  # vLLM's shape
            events.append(
                BlockStored(
                    block_hashes=[hash_to_int(block_hash)],
                    parent_block_hash=None if parent is None else hash_to_int(parent),
                    token_ids=tokens,
                    block_size=self.layout.block_size,
                    lora_id=lora and lora.lora_int_id,
                    medium=STORE_MEDIUM,
                    lora_name=lora and lora.lora_name,
                    extra_keys=None if router_keys is not None else extra,
                    router_keys=router_keys,
                    lora_digest=lora and lora.digest,
                )
            )
        events += [BlockRemoved([hash_to_int(h)], STORE_MEDIUM) for h in missed]
        return events

    def step_failed(self, metadata: KVConnectorMetadata) -> None:
        for t in metadata.saves:
            for block_hash in t.block_hashes:
                self._save_plans.pop(block_hash, None)
            num_full = len(t.block_hashes) - (1 if t.tail_tokens else 0)
            if t.tail_tokens:
                self._tails.pop(t.req_id, None)
            if t.req_id in self._saved_upto:
                self._saved_upto[t.req_id] -= num_full

    def request_finished(
        self, request: KVRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        delay_free = rid in self._has_saves
        self._has_saves.discard(rid)
        self._saved_upto.pop(rid, None)
        self._known_prefix.pop(rid, None)
        self._chains.pop(rid, None)
        self._lookups.pop(rid, None)
        tail = self._tails.pop(rid, None)
        wants = (request.kv_transfer_params or {}).get("do_remote_decode")
        if not (self.config.is_producer and wants):
            return delay_free, None
        n = min(request.num_prompt_tokens // self.layout.block_size, len(request.block_hashes))
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "block_hashes": [h.hex() for h in request.block_hashes[:n]],
            "num_tokens": n * self.layout.block_size,
            "pool": self.config.pool,
            "fingerprint": self.layout.fingerprint,
            "kv_connector": self.config.kv_connector,
            "kv_heads_per_value": self.layout.value_heads or self.layout.num_kv_heads,
        }
        if tail is not None:  # the prompt's partial last block, saved with the full ones
            params["tail_hash"] = tail.hex()
            params["num_tokens"] = request.num_prompt_tokens
        return delay_free, params

    def close(self) -> None:
        self._lookup_pool.shutdown(wait=True, cancel_futures=True)
