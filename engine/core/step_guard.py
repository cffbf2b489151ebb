"""Keeps an exception in one step from taking the engine core down.

A step runs a batch, so an exception there names no request. ``StepGuard`` rolls the
failed step back (every request of the batch is preempted: recomputed later, token-exact,
and the blocks it named in the prefix cache that step are forgotten, since their KV was
never written), then runs the requests of that batch one at a time ("solo") until each has
sampled a token. A request whose solo step fails is the culprit: it alone finishes with an
error. A request caught in ``MAX_STRIKES`` failed batches is failed too, so a failure that
only a combination of requests triggers cannot loop forever.

A step that needs images no store could give and whose pixels the pod never got
(``MissingPixelsError``) is no fault: it is rolled back and only the requests of those images
fail, with 503 (their senders send them again, with the images).

A ``schedule()`` that raises is undone the same way (``contain_schedule``): the request it
was handling, when it can tell, fails alone; otherwise the batch it was building is
isolated as above. Every running request is recomputed, the core lives.

Fault injection for tests: ``EPDSERVE_INJECT_FAULT=<stage>:<marker>`` makes stage
``schedule`` (the scheduler looking at one request), ``execute`` (the model runner) or
``update`` (the per-request update after it) raise for any batch holding a request whose
id or label (the client's ``X-Request-Id``) contains ``marker``; in a worker, ``ranks``
(every rank, before its step) or ``rank<N>`` (rank N alone), by request id. Unset in
production.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from epdserve.engine.core.interfaces import (
    MISSING_ITEM_STATUS,
    EngineCoreOutput,
    MissingPixelsError,
    ModelRunnerOutput,
    SchedulerOutput,
)
from epdserve.engine.core.request import RequestStatus

if TYPE_CHECKING:
    from epdserve.engine.core.scheduler import Scheduler

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


class StepGuard:
    """Contains failed steps; tells the scheduler which request may run alone. It changes
    the scheduler only through its methods (``rollback``, ``undo_schedule``, ``run_solo``,
    ``finish_requests``)."""

    def __init__(self, max_strikes: int = MAX_STRIKES):
        self.max_strikes = max_strikes
        self.suspects: list[str] = []  # requests of failed batches, tried alone in order
        self.strikes: dict[str, int] = {}
        self.num_failed_steps = 0
        self.num_failed_requests = 0

    def choose_solo(self, scheduler: Scheduler) -> None:
        """Before a step: tell the scheduler the request to run alone (None: every one)."""
        while self.suspects and not scheduler.has_request(self.suspects[0]):
            self.strikes.pop(self.suspects.pop(0), None)  # finished or aborted meanwhile
        scheduler.run_solo(self.suspects[0] if self.suspects else None)

    def contain(
        self, scheduler: Scheduler, sched: SchedulerOutput, exc: Exception
    ) -> list[EngineCoreOutput]:
        """Roll back a step whose execution raised; error outputs for the culprits."""
        batch = scheduler.rollback(sched)
        if isinstance(exc, MissingPixelsError) and exc.request_ids:
            # not a fault (no failed step to alert on): their images' outputs are gone, they
            # are counted as request errors; the rest of the batch runs again
            log.warning("step rolled back: %s (requests %s)", exc, exc.request_ids)
            return self.fail(scheduler, exc.request_ids, str(exc), MISSING_ITEM_STATUS)
        self.num_failed_steps += 1
        log.error(
            "step failed for a batch of %d requests (%s: %s); isolating",
            len(batch),
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        if not batch:
            raise exc  # nothing to blame: the step itself is broken
        return self._isolate(scheduler, batch, exc)

    def contain_schedule(self, scheduler: Scheduler, exc: Exception) -> list[EngineCoreOutput]:
        """Undo a ``schedule()`` that raised: the request it was handling fails alone when it
        can tell; otherwise the batch it was building (or, if none yet, every live request)
        is isolated. Never raises: a scheduler fault must not end the core."""
        self.num_failed_steps += 1
        culprit, batch = scheduler.undo_schedule()
        log.error(
            "scheduling failed on %s (%s: %s)",
            f"request {_named(scheduler, culprit)}" if culprit else "no one request; isolating",
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        if culprit is not None:
            return self.fail(scheduler, [culprit], f"{type(exc).__name__}: {exc}")
        batch = [r for r in batch if scheduler.has_request(r)] or scheduler.request_ids()
        return self._isolate(scheduler, batch, exc) if batch else []

    def _isolate(
        self, scheduler: Scheduler, batch: list[str], exc: Exception
    ) -> list[EngineCoreOutput]:
        """Strike the batch; a lone or thrice-struck request fails, the rest run solo next."""
        for req_id in batch:
            self.strikes[req_id] = self.strikes.get(req_id, 0) + 1
        culprits = [r for r in batch if len(batch) == 1 or self.strikes[r] >= self.max_strikes]
        for req_id in batch:
            if req_id not in culprits and req_id not in self.suspects:
                self.suspects.append(req_id)
        return self.fail(scheduler, culprits, f"{type(exc).__name__}: {exc}")

    def fail(
        self, scheduler: Scheduler, request_ids: list[str], reason: str, status: int = 500
    ) -> list[EngineCoreOutput]:
        """Finish ``request_ids`` with an error (their blocks are freed); ``status`` is the
        HTTP status their clients get."""
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
                    error_status=status,
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


def _named(scheduler: Scheduler, req_id: str) -> str:
    """``id`` or ``id (X-Request-Id label)`` for logs."""
    label = scheduler.label_of(req_id)
    return f"{req_id} (X-Request-Id {label!r})" if label else req_id
