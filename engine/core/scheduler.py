"""Token-budget scheduler (vLLM v1): no prefill/decode phases, running requests first.

Each step, every scheduled request's ``num_computed_tokens`` catches up with its tokens
by up to its share of the budget; long prompts are chunked; when blocks run out the
lowest-priority running request is preempted (recomputed later). Where requests are and
how they move outside admission (finish, preempt, roll back) is ``request_queues.py``.

Policies (``waiting_queue.py``): ``fcfs`` starts waiting requests by arrival and preempts
the last running one; ``priority`` starts them by ``(priority, arrival_time)`` and preempts
the running one with the largest key (unscheduled first if this step had scheduled it). As
in vLLM v1 a waiting request never preempts running ones: a high-priority arrival with no
free slot or blocks waits at the head of the queue, ahead of every lower-priority request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epdserve.connectors.kv_connector import ScheduledRequest
from epdserve.engine.core.interfaces import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from epdserve.engine.core.kv_cache_manager import KVCacheManager
from epdserve.engine.core.mm_scheduling import EncoderScheduler
from epdserve.engine.core.request import Request, RequestStatus
from epdserve.engine.core.request_queues import RequestQueues
from epdserve.engine.core.sched_utils import apply_step_output, room_after
from epdserve.engine.core.step_guard import injected_fault, maybe_fail
from epdserve.engine.core.waiting_queue import victim_index
from epdserve.engine.kv_transfer.coordinator import LoadStart

if TYPE_CHECKING:
    from epdserve.engine.kv_transfer.coordinator import KVTransferCoordinator
    from epdserve.engine.lora.manager import LoRAManager


class Scheduler(RequestQueues):
    """Each step's batch within the token budget, and the step's results applied."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        kv_transfer: KVTransferCoordinator | None = None,
        encoder: EncoderScheduler | None = None,
        lora: LoRAManager | None = None,
        policy: str = "fcfs",
    ):
        super().__init__(kv_cache_manager, kv_transfer, encoder, lora, policy)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.prompt_sources = [0, 0, 0]  # prompt tokens: computed, local cache hit, loaded
        self.update_failures: list[tuple[str, Exception]] = []  # of the last update
        # overlapped scheduling (engine/core/overlap.py): a step samples into placeholders;
        # while one is in flight no request is preempted (``preemption_deferred`` says so)
        self.overlapped, self.step_in_flight, self.preemption_deferred = False, False, False

    # --- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's batch. If it raises, ``undo_schedule()`` puts every request back."""
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        self.scheduling, self._step_scheduled, self._step_advanced = None, num_scheduled, False
        self.preemption_deferred = False
        self._step_output = None
        faults = injected_fault("schedule") is not None  # tests only: one env read per step
        if self.encoder is not None:
            self.encoder.begin_step()
        new_reqs: list[Request] = []
        cached_reqs: list[Request] = []
        new_block_ids: list[list[list[int]]] = []  # of cached_reqs, in their order
        preempted = False

        i = 0
        solo = self.requests.get(self.solo_id) if self.solo_id else None
        if solo is not None and solo.status != RequestStatus.RUNNING and solo in self.waiting:
            self.waiting.remove(solo)  # a solo run admits only this request
            self.waiting.put_first([solo])
        kv, max_len, running = self.kv, self.max_model_len, self.running
        no_new, no_ids = kv.no_new_blocks, [[] for _ in range(kv.num_groups)]
        while i < len(running) and budget > 0:  # the common path is lean: it runs per request
            request = running[i]
            if solo is not None and request is not solo:
                i += 1
                continue
            self.scheduling = request
            if faults:
                maybe_fail("schedule", (request.request_id,), self.label_of)
            computed = request.num_computed_tokens
            pending = request.num_output_placeholders  # 0 unless steps overlap
            if pending and not room_after(request, max_len):
                i += 1  # the tokens in flight end it by length: no step past them
                continue
            n = len(request.all_token_ids) + pending - computed
            if n > budget:
                n = budget
            if n > max_len - computed:
                n = max_len - computed
            if request.mm_features:
                n = self.encoder.fit(request, computed, n)
            if n <= 0:
                i += 1
                continue
            blocks = kv.allocate_slots(request, n)
            if blocks is None and self.step_in_flight:  # preempt once its step is done
                self.preemption_deferred = preempted = True
                break
            while blocks is None:
                v = victim_index(self.running, self.policy)
                victim = self.running[v]
                done = victim.request_id in num_scheduled
                if done and self.encoder is not None and victim.request_id in self.encoder.inputs:
                    break  # its images are encoded this step: it keeps its blocks for now
                if done:  # priority only: scheduled earlier this step, undone
                    self.kv.forget_uncomputed(victim, victim.num_computed_tokens)
                    budget += num_scheduled.pop(victim.request_id)
                    del new_block_ids[cached_reqs.index(victim)]
                    cached_reqs.remove(victim)
                del self.running[v]
                if v < i:  # priority only: the victim ran ahead of ``request``
                    i -= 1
                self._requeue_preempted(victim)
                preempted = True
                if victim is request:
                    break
                blocks = self.kv.allocate_slots(request, n)
            if blocks is None:
                break
            cached_reqs.append(request)
            new_block_ids.append(
                no_ids if blocks is no_new else [[b.block_id for b in g] for g in blocks]
            )
            num_scheduled[request.request_id] = n
            budget -= n
            i += 1

        skipped: list[Request] = []  # their store lookups (or adapters) are still in flight
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            if solo is not None and request is not solo:
                break
            self.scheduling = request
            if faults:
                maybe_fail("schedule", (request.request_id,), self.label_of)
            if request.lora is not None and not self.lora_ready(request):
                skipped.append(self.waiting.popleft())  # its adapter is loading or slots busy
                continue
            if request.grammar is not None and not self.grammar_ready(request):
                skipped.append(self.waiting.popleft())  # its grammar is compiling
                continue
            admitted = self._admit(request, budget)
            if admitted is LoadStart.NO_ROOM and self._unpin(request):
                admitted = self._admit(request, budget)
            while admitted is LoadStart.NO_ROOM and solo is not None and self.running:
                self.preempt(self.running[-1])  # paused requests make room for the solo run
                self.waiting.remove(solo)
                self.waiting.put_first([solo])
                admitted = self._admit(request, budget)
            if admitted is LoadStart.NO_ROOM:
                break
            self.waiting.popleft()
            if admitted is LoadStart.PENDING:
                skipped.append(request)
                continue
            if admitted is LoadStart.STARTED:
                continue  # its prefix is loading; it comes back when the load is done
            num_hit_tokens, n = admitted
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:  # first admission: where its prompt comes from
                request.num_cached_tokens = num_hit_tokens
                external = request.num_external_computed_tokens
                self.prompt_sources[0] += request.num_prompt_tokens - num_hit_tokens
                self.prompt_sources[1] += num_hit_tokens - external
                self.prompt_sources[2] += external
            new_reqs.append(request)
            num_scheduled[request.request_id] = n
            budget -= n

        self.waiting.extendleft(reversed(skipped))
        self.scheduling = None
        out = self._build_output(new_reqs, cached_reqs, new_block_ids, num_scheduled)
        self._step_scheduled, self._step_advanced, self._step_output = {}, False, None
        return out

    def _admit(self, request: Request, budget: int) -> tuple[int, int] | LoadStart:
        """Allocate a waiting request's blocks: ``(computed tokens, tokens to schedule)``, or
        why not (no room; its prefix is loading; its lookup is pending)."""
        if self.kv.has_blocks(request.request_id):  # a finished load left its blocks
            num_hit_tokens = request.num_computed_tokens
            n = min(request.num_tokens - num_hit_tokens, budget)
            if request.mm_features:  # images past the loaded blocks still need encoding
                n = self.encoder.fit(request, num_hit_tokens, n)
                if n <= 0:
                    return LoadStart.NO_ROOM
            if self.kv.allocate_slots(request, n) is None:
                return LoadStart.NO_ROOM
            return num_hit_tokens, n
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        if self.kv_transfer is not None:
            started = self.kv_transfer.start_load(request, hits, num_hit_tokens)
            if started is not LoadStart.NOTHING:
                return started
        n = min(request.num_tokens - num_hit_tokens, budget)
        if request.mm_features:
            n = self.encoder.fit(request, num_hit_tokens, n)
            if n <= 0:
                return LoadStart.NO_ROOM
        if self.kv.allocate_slots(request, n, num_hit_tokens, hits) is None:
            return LoadStart.NO_ROOM
        return num_hit_tokens, n

    def _build_output(self, new_reqs, cached_reqs, new_block_ids, num_scheduled) -> SchedulerOutput:
        new_data = [
            NewRequestData(
                r.request_id,
                list(r.all_token_ids),
                r.params,
                self.kv.get_group_block_ids(r.request_id),
                r.num_computed_tokens,
                r.num_prompt_tokens,
                r.mm_features,
                self.lora.slot_of(r.lora) if self.lora is not None else -1,
            )
            for r in new_reqs
        ]
        cached = CachedRequestData(
            [r.request_id for r in cached_reqs],
            new_block_ids,
            [r.num_computed_tokens for r in cached_reqs],
        )
        finished = sorted(self.finished_req_ids)
        out = SchedulerOutput(
            new_data, cached, num_scheduled, sum(num_scheduled.values()), finished
        )
        self.finished_req_ids.clear()
        self._step_output = out  # undo_schedule() tells its finished ids again
        requests = self.requests
        for req_id, n in num_scheduled.items():
            request = requests[req_id]
            request.num_computed_tokens += n
            if self.overlapped and request.num_computed_tokens >= (
                request.num_tokens + request.num_output_placeholders
            ):  # it samples this step: its token is a placeholder until the output comes
                request.num_output_placeholders += 1
        self._step_advanced = True
        if self.encoder is not None:
            for req_id in num_scheduled:
                self.encoder.after_step(self.requests[req_id])
            out.scheduled_encoder_inputs = self.encoder.take_inputs()
            out.encoder_loads = self.encoder.remote_items(
                self.requests, out.scheduled_encoder_inputs
            )
            freed = self.encoder.cache.take_freed()
            out.free_encoder_ids, self.untold_encoder_frees = self.untold_encoder_frees + freed, []
        if self.kv_transfer is not None:
            out.kv_connector_metadata = self.kv_transfer.build_meta(
                [
                    ScheduledRequest(r, self.kv.get_block_ids(r.request_id), r.num_computed_tokens)
                    for r in new_reqs + cached_reqs
                ]
            )
        return out

    # --- after the forward -------------------------------------------------------------
    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, owners: list | None = None
    ) -> list[EngineCoreOutput]:
        """Apply a step's output. ``owners`` (overlapped steps): the requests it ran, in batch
        order; a row whose id now names another request (finished, and the id reused) is
        dropped."""
        return apply_step_output(self, result, owners)
