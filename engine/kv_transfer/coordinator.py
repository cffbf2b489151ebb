"""Scheduler-side glue between the scheduler, the KV cache manager and a KV connector.

State machine of a request whose prefix a connector loads (vLLM v1's async-load path):
``WAITING`` → lookup finds ``n`` external tokens → blocks allocated (not yet named in the
prefix cache) → ``WAITING_FOR_REMOTE_KVS`` while the worker loads → the load reports done →
only the blocks before the first one that failed are credited (``num_computed_tokens``; the
last block may be credited in part: a prompt's partial last block, or a full one holding the
prompt's last token) and the full ones cached → ``WAITING`` at the head of the queue →
scheduled to compute the rest. A failed block is thus recomputed before any forward reads
it, and outputs stay token-exact.

Saves are asked for right after the forward that fills a prompt block; a request that
finishes (or is preempted) while its saves run keeps its blocks until the worker reports
them done, and a P/D prefill request's last output is held until then too, so the next pod
finds every block the response names.
"""

from __future__ import annotations

import enum

from epdserve.connectors.kv_connector import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    ScheduledRequest,
)
from epdserve.engine.core.interfaces import EngineCoreOutput
from epdserve.engine.core.kv_cache_manager import GroupBlocks, KVCacheManager
from epdserve.engine.core.request import Request, RequestStatus


class LoadStart(enum.Enum):
    """What admitting a waiting request did about its external prefix."""

    NOTHING = 0  # nothing to load: schedule it as usual
    STARTED = 1  # its blocks are allocated and loading: it waits (WAITING_FOR_REMOTE_KVS)
    NO_ROOM = 2  # not enough free blocks for what it would load
    PENDING = 3  # the store has not answered the lookup yet: try again next step


class KVTransferCoordinator:
    """The scheduler's side of KV transfer: loads in flight, blocks and answers held for saves,
    and the external prefix-cache counters (``queries``/``hits``/``load_failures``)."""

    def __init__(self, connector: KVConnectorBase, kv: KVCacheManager, can_load: bool):
        self.connector = connector
        self.kv = kv
        self.can_load = can_load
        self.loading: dict[str, tuple[Request, int]] = {}  # req -> (request, external tokens)
        self.saving: set[str] = set()  # requests with saves not yet reported done
        self.carried_loads: list = []  # loads of a failed step, for the next one
        self.newly_saving: set[str] = set()  # requests the last metadata added to ``saving``
        self.held_blocks: dict[str, list[GroupBlocks]] = {}
        self.held_outputs: dict[str, EngineCoreOutput] = {}
        self.queries = 0  # tokens looked up
        self.hits = 0  # tokens loaded
        self.load_failures = 0  # blocks that failed to load

    def has_pending(self) -> bool:
        return bool(self.loading or self.held_blocks or self.held_outputs)

    # --- admission ----------------------------------------------------------------------
    def start_load(self, request: Request, hits: GroupBlocks, num_local: int) -> LoadStart:
        """Ask the connector about the request's prefix beyond its ``num_local`` cached tokens
        and start loading it into newly allocated blocks if there is one."""
        if request.skip_prefix_cache:
            return LoadStart.NOTHING
        n_ext, _ = self.connector.get_num_new_matched_tokens(request, num_local)
        if n_ext is None:
            return LoadStart.PENDING
        if n_ext <= 0:
            self.queries += request.num_tokens if self.can_load else 0
            return LoadStart.NOTHING
        if self.kv.allocate_slots(request, 0, num_local + n_ext, hits, delay_cache=True) is None:
            return LoadStart.NO_ROOM
        self.queries += request.num_tokens
        request.num_computed_tokens = num_local
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), n_ext
        )
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = (request, n_ext)
        return LoadStart.STARTED

    def unpin(self, waiting, head: Request) -> bool:
        """Nothing runs and ``head`` does not fit: free the blocks other waiting requests got
        from finished loads (they stay in the prefix cache, so re-admission finds them)."""
        pinned = [r for r in waiting if r is not head and self.kv.has_blocks(r.request_id)]
        for request in pinned:
            self.kv.free(request)
            request.num_computed_tokens = 0
        return bool(pinned)

    def build_meta(self, scheduled: list[ScheduledRequest]) -> KVConnectorMetadata:
        meta = self.connector.build_connector_meta(scheduled)
        if self.carried_loads:  # loads of a failed step, started now
            meta.loads = self.carried_loads + meta.loads
            self.carried_loads = []
        self.newly_saving = {t.req_id for t in meta.saves} - self.saving
        self.saving |= self.newly_saving
        return meta

    def step_failed(self, meta: KVConnectorMetadata | None) -> None:
        """The step carrying ``meta`` (the last one built) raised before its forward
        finished: its saves are dropped (their blocks were never computed), so requests
        whose only saves they were are not waited for; its loads go out with the next step
        (a load the worker had already started is started again: same blocks, same bytes)."""
        if meta is not None:
            self.connector.step_failed(meta)
            self.carried_loads.extend(meta.loads)
            self.saving -= self.newly_saving
            self.newly_saving = set()

    # --- after the step -------------------------------------------------------------------
    def update(self, out: KVConnectorOutput | None) -> tuple[list[Request], list]:
        """Apply the worker's report: (loaded requests to queue again, released outputs)."""
        if out is None:
            return [], []
        self.connector.update_connector_output(out)
        invalid = set(out.invalid_block_ids)
        ready = [self._finish_load(r, invalid) for r in out.finished_recving]
        ready = [r for r in ready if r is not None]
        released = []
        for req_id in out.finished_sending:
            self.saving.discard(req_id)
            self._release(req_id)
            if req_id in self.held_outputs:
                released.append(self.held_outputs.pop(req_id))
        return ready, released

    def _finish_load(self, req_id: str, invalid: set[int]) -> Request | None:
        entry = self.loading.pop(req_id, None)
        if entry is None:  # aborted while loading: its blocks were kept for the load
            self._release(req_id)
            return None
        request, n_ext = entry
        bs = self.kv.block_size
        first = request.num_computed_tokens // bs
        last = -(-(request.num_computed_tokens + n_ext) // bs)  # the last may be partly loaded
        block_ids = self.kv.get_block_ids(req_id)[first:last]
        valid = next((i for i, b in enumerate(block_ids) if b in invalid), len(block_ids))
        credited = min(valid * bs, n_ext)
        request.num_computed_tokens += credited
        request.num_external_computed_tokens = credited
        self.kv.cache_blocks(request, request.num_computed_tokens)  # full blocks only
        self.hits += credited
        self.load_failures += len(block_ids) - valid
        request.status = RequestStatus.WAITING
        return request

    # --- leaving ----------------------------------------------------------------------------
    def finish(self, request: Request) -> tuple[dict | None, bool]:
        """Tell the connector; free the blocks or keep them while it still uses them.
        Returns ``(kv_transfer_params, held)``."""
        req_id = request.request_id
        delay_free, params = self.connector.request_finished(request, self.kv.get_block_ids(req_id))
        held = self.loading.pop(req_id, None) is not None or (delay_free and req_id in self.saving)
        self._free_or_hold(request, held)
        return params, held

    def preempt(self, request: Request) -> None:
        self._free_or_hold(request, request.request_id in self.saving)

    def hold_output(self, output: EngineCoreOutput) -> None:
        self.held_outputs[output.request_id] = output

    def _free_or_hold(self, request: Request, hold: bool) -> None:
        if hold:
            self.held_blocks.setdefault(request.request_id, []).append(self.kv.detach(request))
        else:
            self.kv.free(request)

    def _release(self, req_id: str) -> None:
        for blocks in self.held_blocks.pop(req_id, []):
            self.kv.release(blocks)
