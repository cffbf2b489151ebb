"""Keeps an exception in one step from taking the engine core down.

A step runs a batch, so an exception there names no request. ``StepGuard`` rolls the
failed step back (every request of the batch is preempted: recomputed later, token-exact,
and the blocks it named in the prefix cache that step are forgotten, since their KV was
never written), then runs the requests of that batch one at a time ("solo") until each has
sampled a token. A request whose solo step fails is the culprit: it alone finishes with an
error. A request caught in ``MAX_STRIKES`` failed batches is failed too, so a failure that
only a combination of requests triggers cannot loop forever.

A ``schedule()`` that raises is undone the same way (``contain_schedule``): the request it
was handling, when it can tell, fails alone; otherwise the batch it was building is
isolated as above. Every running request is recomputed, the core lives.

Fault injection for tests: ``EPDSERVE_INJECT_FAULT=<stage>:<marker>`` makes stage
``schedule`` (the scheduler looking at one request), ``execute`` (the model runner) or
``update`` (the per-request update after it) raise for any batch holding a request whose
id or label (the client's ``X-Request-Id``) contains ``marker``. Unset in production.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from epdserve.engine.core.interfaces import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from epdserve.engine.core.request import RequestStatus

log = logging.getLogger("epdserve.core")

MAX_STRIKES = 3


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault (``EPDSERVE_INJECT_FAULT``)."""


def injected_fault(stage: str) -> str | None:
    """The request-id marker for which ``stage`` must fail, if a test asked for one."""
    spec = os.environ.get("EPDSERVE_INJECT_FAULT", "")
    where, sep, marker = spec.partition(":")
    return marker if sep and where == stage and marker else None


def maybe_fail(stage: str, request_ids, label_of: Callable[[str], str | None] | None = None):
    """Raise if a test asked ``stage`` to fail for one of ``request_ids`` (by id or label)."""
    marker = injected_fault(stage)
    if marker is None:
        return
    for req_id in request_ids:
        label = label_of(req_id) if label_of is not None else None
        if marker in req_id or (label is not None and marker in label):
            raise InjectedFault(f"injected fault in stage {stage} for request {req_id}")


def roll_back(scheduler, sched: SchedulerOutput) -> None:
    """Undo a step whose execution raised: its requests are preempted, and the blocks they
    named in the prefix cache for this step are forgotten (their KV may never have been
    written)."""
    if scheduler.kv_transfer is not None:  # first: preempting asks who is still saving
        scheduler.kv_transfer.step_failed(sched.kv_connector_metadata)
    for req_id, n in sched.num_scheduled_tokens.items():
        request = scheduler.requests.get(req_id)
        if request is None or request.status != RequestStatus.RUNNING:
            continue
        scheduler.kv.forget_uncomputed(request, request.num_computed_tokens - n)
        scheduler.preempt(request)
    # what the runner was to be told this step it is told with the next one
    scheduler.finished_req_ids.update(sched.finished_req_ids)
    if scheduler.encoder is not None:
        scheduler.encoder.cache.freed.extend(sched.free_encoder_ids)


def undo_schedule(scheduler) -> tuple[str | None, list[str]]:
    """Undo a ``schedule()`` that raised midway: ``(the request it was handling when it
    raised or None, the requests it had scheduled)``. Every running request is preempted
    (recomputed later, token-exact) once the blocks this step named past its computed
    tokens are un-named; requests it had taken off the queue go back to it."""
    culprit, scheduler.scheduling = scheduler.scheduling, None
    scheduled, scheduler._step_scheduled = scheduler._step_scheduled, {}
    advanced = scheduled if scheduler._step_advanced else {}
    out, scheduler._step_output, scheduler._step_advanced = scheduler._step_output, None, False
    if out is not None:  # what the runner was to be told this step it is told with the next
        scheduler.finished_req_ids.update(out.finished_req_ids)
        if scheduler.encoder is not None:
            scheduler.encoder.cache.freed.extend(out.free_encoder_ids)
    if culprit is not None and culprit.status != RequestStatus.RUNNING:
        scheduler.kv.forget_uncomputed(culprit, 0)  # what its admission may have named
    for request in list(scheduler.running):
        computed = request.num_computed_tokens - advanced.get(request.request_id, 0)
        scheduler.kv.forget_uncomputed(request, computed)
        scheduler.preempt(request)
    queued = {id(r) for r in scheduler.waiting}
    for request in list(scheduler.requests.values()):
        if id(request) in queued or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        scheduler.kv.forget_uncomputed(request, 0)
        if request.status == RequestStatus.RUNNING:  # taken off ``running`` midway
            scheduler.preempt(request)
        else:
            scheduler.waiting.appendleft(request)
    return (culprit.request_id if culprit is not None else None), list(scheduled)


class StepGuard:
    """Contains failed steps; tells the scheduler which request may run alone."""

    def __init__(self, max_strikes: int = MAX_STRIKES):
        self.max_strikes = max_strikes
        self.suspects: list[str] = []  # requests of failed batches, tried alone in order
        self.strikes: dict[str, int] = {}
        self.num_failed_steps = 0
        self.num_failed_requests = 0

    def solo(self, live: dict) -> str | None:
        """The request to run alone this step (None: schedule normally)."""
        while self.suspects and self.suspects[0] not in live:
            self.strikes.pop(self.suspects.pop(0), None)  # finished or aborted meanwhile
        return self.suspects[0] if self.suspects else None

    def contain(self, scheduler, sched: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """Roll back a step whose execution raised; error outputs for the culprits."""
        self.num_failed_steps += 1
        batch = [r for r in sched.num_scheduled_tokens if r in scheduler.requests]
        log.error(
            "step failed for a batch of %d requests (%s: %s); isolating",
            len(batch),
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        roll_back(scheduler, sched)
        if not batch:
            raise exc  # nothing to blame: the step itself is broken
        return self._isolate(scheduler, batch, exc)

    def contain_schedule(self, scheduler, exc: Exception) -> list[EngineCoreOutput]:
        """Undo a ``schedule()`` that raised: the request it was handling fails alone when it
        can tell; otherwise the batch it was building (or, if none yet, every live request)
        is isolated. Never raises: a scheduler fault must not end the core."""
        self.num_failed_steps += 1
        culprit, batch = undo_schedule(scheduler)
        log.error(
            "scheduling failed on %s (%s: %s)",
            f"request {_named(scheduler, culprit)}" if culprit else "no one request; isolating",
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        if culprit is not None:
            return self.fail(scheduler, [culprit], f"{type(exc).__name__}: {exc}")
        batch = [r for r in batch if r in scheduler.requests] or list(scheduler.requests)
        return self._isolate(scheduler, batch, exc) if batch else []

    def _isolate(self, scheduler, batch: list[str], exc: Exception) -> list[EngineCoreOutput]:
        """Strike the batch; a lone or thrice-struck request fails, the rest run solo next."""
        for req_id in batch:
            self.strikes[req_id] = self.strikes.get(req_id, 0) + 1
        culprits = [r for r in batch if len(batch) == 1 or self.strikes[r] >= self.max_strikes]
        for req_id in batch:
            if req_id not in culprits and req_id not in self.suspects:
                self.suspects.append(req_id)
        return self.fail(scheduler, culprits, f"{type(exc).__name__}: {exc}")

    def fail(self, scheduler, request_ids: list[str], reason: str) -> list[EngineCoreOutput]:
        """Finish ``request_ids`` with an error (their blocks are freed)."""
        names = {r: _named(scheduler, r) for r in request_ids}
        scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = []
        for req_id in request_ids:  # also those already gone: their client must hear of it
            self.num_failed_requests += 1
            self.strikes.pop(req_id, None)
            if req_id in self.suspects:
                self.suspects.remove(req_id)
            log.error("request %s failed: %s", names[req_id], reason)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    [],
                    finish_reason="abort",
                    error=f"the engine failed while serving this request ({reason})",
                )
            )
        return outputs

    def passed(self, result: ModelRunnerOutput) -> None:
        """A step succeeded: the solo request is cleared once it has sampled a token."""
        if not self.suspects:
            return
        solo = self.suspects[0]
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids, strict=True):
            if req_id == solo and tokens:
                self.suspects.pop(0)
                self.strikes.pop(solo, None)
                return


def _named(scheduler, req_id: str) -> str:
    """``id`` or ``id (X-Request-Id label)`` for logs."""
    label = scheduler.label_of(req_id)
    return f"{req_id} (X-Request-Id {label!r})" if label else req_id
