"""Where every live request of the scheduler is, and the moves between those places.

A request is waiting (``waiting``, in its policy's order: ``waiting_queue.py``), running
(``running``), or loading its prefix (``WAITING_FOR_REMOTE_KVS``, held by the KV-transfer
coordinator). ``RequestQueues`` owns these places and every move that is not admission:
adding, finishing, preempting, and undoing a step that was scheduled but never computed
(what the step guard asks for).
``Scheduler`` (``scheduler.py``) builds on it with the per-step policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from epdserve.engine.core.interfaces import EngineCoreOutput, SchedulerOutput
from epdserve.engine.core.kv_cache_manager import KVCacheManager
from epdserve.engine.core.mm_scheduling import EncoderScheduler
from epdserve.engine.core.request import Request, RequestStatus
from epdserve.engine.core.waiting_queue import make_waiting_queue

if TYPE_CHECKING:
    from epdserve.engine.kv_transfer.coordinator import KVTransferCoordinator
    from epdserve.engine.lora.manager import LoRAManager


class UndoneSchedule(NamedTuple):
    """What ``undo_schedule`` found of a ``schedule()`` that raised midway."""

    culprit: str | None  # the request it was handling when it raised, if any
    scheduled: list[str]  # the requests it had scheduled before that


class RequestQueues:
    """The scheduler's requests, their queues, and what the runner must be told of them."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        kv_transfer: KVTransferCoordinator | None = None,
        encoder: EncoderScheduler | None = None,
        lora: LoRAManager | None = None,
        policy: str = "fcfs",
    ):
        self.kv = kv_cache_manager
        self.policy = policy  # fcfs or priority: the waiting order and the preemption victim
        self.lora = lora  # adapters' device slots, when LoRA is on
        # waiting requests that cannot start: their adapter failed to load, their grammar to
        # compile (the core answers each with a 400)
        self.admission_failures: list[tuple[str, Exception]] = []
        self.kv_transfer = kv_transfer  # a KV connector's scheduler side, if any
        self.encoder = encoder  # multimodal models: encoder inputs and their cache
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(policy)  # engine/core/waiting_queue.py
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner next step
        self.untold_encoder_frees: list[str] = []  # of a rolled-back step, told with the next
        self.num_preemptions = 0
        self.solo_id: str | None = None  # see run_solo()
        # what schedule() is doing, so that a step that raised midway can be undone
        self.scheduling: Request | None = None
        self._step_scheduled: dict[str, int] = {}
        self._step_advanced = False
        self._step_output: SchedulerOutput | None = None

    # --- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:  # refused: the live one keeps its state
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        if request.priority and self.policy != "priority":
            raise ValueError("priority: only 0 is accepted unless --scheduling-policy priority")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def lora_ready(self, request: Request) -> bool:
        """Whether a waiting request's adapter is on a device slot, placing it now if its
        weights are read and a slot is free or held by no running request. An adapter that
        failed to load fails the request (``admission_failures``)."""
        if self.lora.touch(request.lora):  # on a slot already: the common case
            return True
        busy = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        try:
            return self.lora.acquire(request.lora, busy)
        except ValueError as exc:
            self.admission_failures.append((request.request_id, exc))
            return False

    def _unpin(self, head: Request) -> bool:
        """Deadlock guard: nothing runs, so free blocks parked by finished loads."""
        transfer = self.kv_transfer
        return transfer is not None and not self.running and transfer.unpin(self.waiting, head)

    def grammar_ready(self, request: Request) -> bool:
        """Whether a waiting request's grammar is compiled; one that failed to compile (or
        in time) fails the request (``admission_failures``)."""
        try:
            return request.grammar.ready()
        except ValueError as exc:
            self.admission_failures.append((request.request_id, exc))
            return False

    def take_admission_failures(self) -> list[EngineCoreOutput]:
        """Finish the requests that could not start, each with a 400 naming why."""
        failures, self.admission_failures = self.admission_failures, []
        outputs = []
        for req_id, exc in failures:
            if not self.finish_requests([req_id], RequestStatus.FINISHED_ABORTED):
                continue  # already gone (aborted meanwhile)
            out = EngineCoreOutput(req_id, [], finish_reason="abort", stop_reason=str(exc))
            out.error, out.error_status = str(exc), 400
            outputs.append(out)
        return outputs

    def adapter_names(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting requests, sorted (for metrics)."""
        running = {r.lora_name for r in self.running if r.lora_name}
        waiting = {r.lora_name for r in self.waiting if r.lora_name}
        return sorted(running), sorted(waiting)

    def label_of(self, request_id: str) -> str | None:
        """The client's label of a live request (``X-Request-Id``): logs and tests only."""
        return getattr(self.requests.get(request_id), "label", None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        """Every live request, in arrival order."""
        return list(self.requests)

    def has_unfinished_requests(self) -> bool:
        pending = self.kv_transfer is not None and self.kv_transfer.has_pending()
        return bool(self.waiting or self.running or pending)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; frees their blocks."""
        done = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.is_finished:  # finished but not yet freed: an update failed midway
                if request in self.running:
                    self.running.remove(request)
            elif request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            done.append(request)
        return done

    def preempt(self, request: Request) -> None:
        """Send a running request back to the head of the queue (its KV is recomputed
        later): its blocks are freed, or held while the connector still saves them."""
        if request in self.running:  # not after a schedule() that raised while preempting it
            self.running.remove(request)
        self._requeue_preempted(request)

    def _requeue_preempted(self, victim: Request) -> None:
        """``preempt`` for a request already taken off ``running``."""
        if self.kv_transfer is None:
            self.kv.free(victim)
        else:
            self.kv_transfer.preempt(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # a step in flight gives its token anyway
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(victim.request_id)  # the runner forgets it
        self.waiting.appendleft(victim)

    def _free(self, request: Request) -> tuple[dict | None, bool]:
        """Free (or hand to the connector) a finished request: ``(kv_transfer_params, held)``."""
        result = None, False
        if self.kv_transfer is None:
            self.kv.free(request)
        else:
            result = self.kv_transfer.finish(request)
        if self.encoder is not None and request.mm_features:
            self.encoder.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return result

    # --- for the step guard --------------------------------------------------------------
    def run_solo(self, request_id: str | None) -> None:
        """From the next ``schedule()`` on, schedule only ``request_id`` (running requests
        are preempted when it needs their blocks); None: schedule every request again.
        Mutates only which request ``schedule()`` picks."""
        self.solo_id = request_id

    def rollback(self, sched: SchedulerOutput) -> list[str]:
        """Undo the step ``sched`` whose forward never ran (or raised): returns the requests
        of its batch that were still running, now preempted (recomputed later, token-exact).
        Mutates: the connector forgets the step's planned saves (its loads go out with the
        next step); the KV manager un-names the blocks those requests named in the prefix
        cache this step (their KV may never have been written) and frees or holds their
        blocks; ``running``/``waiting``; the step's finished request ids and freed encoder
        outputs are told to the runner with the next step."""
        if self.kv_transfer is not None:  # first: preempting asks who is still saving
            self.kv_transfer.step_failed(sched.kv_connector_metadata)
        batch = []
        for req_id, n in sched.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.kv.forget_uncomputed(request, request.num_computed_tokens - n)
            self.preempt(request)
            batch.append(req_id)
        self.finished_req_ids.update(sched.finished_req_ids)
        self.untold_encoder_frees += sched.free_encoder_ids
        return batch

    def undo_schedule(self) -> UndoneSchedule:
        """Undo a ``schedule()`` that raised midway. Mutates: every running request is
        preempted (recomputed later, token-exact) once the KV manager un-names the blocks
        this step named past its computed tokens; requests it had taken off the queue go
        back to it (blocks their admission named are un-named and freed); if it had built
        its output, that output's finished request ids and freed encoder outputs are told
        to the runner with the next step."""
        culprit, self.scheduling = self.scheduling, None
        scheduled, self._step_scheduled = self._step_scheduled, {}
        advanced = scheduled if self._step_advanced else {}
        out, self._step_output, self._step_advanced = self._step_output, None, False
        if out is not None:
            self.finished_req_ids.update(out.finished_req_ids)
            self.untold_encoder_frees += out.free_encoder_ids
        if culprit is not None and culprit.status != RequestStatus.RUNNING:
            self.kv.forget_uncomputed(culprit, 0)  # what its admission may have named
        for request in list(self.running):
            computed = request.num_computed_tokens - advanced.get(request.request_id, 0)
            self.kv.forget_uncomputed(request, computed)
            self.preempt(request)
        queued = {id(r) for r in self.waiting}
        for request in list(self.requests.values()):
            if id(request) in queued or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            self.kv.forget_uncomputed(request, 0)
            if request.status == RequestStatus.RUNNING:  # taken off ``running`` midway
                self.preempt(request)
            else:
                self.waiting.appendleft(request)
        return UndoneSchedule(culprit.request_id if culprit is not None else None, list(scheduled))

    # --- stats ---------------------------------------------------------------------------
    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        loading = len(self.kv_transfer.loading) if self.kv_transfer is not None else 0
        return len(self.waiting) + loading
