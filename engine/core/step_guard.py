"""Keeps an exception in one step from taking the engine core down.

A step runs a batch, so an exception there names no request. ``StepGuard`` rolls the
failed step back (every request of the batch is preempted: recomputed later, token-exact,
and the blocks it named in the prefix cache that step are forgotten, since their KV was
never written), then runs the requests of that batch one at a time ("solo") until each has
sampled a token. A request whose solo step fails is the culprit: it alone finishes with an
error. A request caught in ``MAX_STRIKES`` failed batches is failed too, so a failure that
only a combination of requests triggers cannot loop forever.

Fault injection for tests: ``EPDSERVE_INJECT_FAULT=<stage>:<marker>`` makes stage
``execute`` (the model runner) or ``update`` (the per-request update after it) raise for
any batch holding a request whose id contains ``marker``. Unset in production.
"""

from __future__ import annotations

import logging
import os

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


def maybe_fail(stage: str, request_ids) -> None:
    marker = injected_fault(stage)
    if marker is not None:
        hit = next((r for r in request_ids if marker in r), None)
        if hit is not None:
            raise InjectedFault(f"injected fault in stage {stage} for request {hit}")


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
        for req_id in batch:
            self.strikes[req_id] = self.strikes.get(req_id, 0) + 1
        culprits = [r for r in batch if len(batch) == 1 or self.strikes[r] >= self.max_strikes]
        for req_id in batch:
            if req_id not in culprits and req_id not in self.suspects:
                self.suspects.append(req_id)
        return self.fail(scheduler, culprits, f"{type(exc).__name__}: {exc}")

    def fail(self, scheduler, request_ids: list[str], reason: str) -> list[EngineCoreOutput]:
        """Finish ``request_ids`` with an error (their blocks are freed)."""
        scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = []
        for req_id in request_ids:  # also those already gone: their client must hear of it
            self.num_failed_requests += 1
            self.strikes.pop(req_id, None)
            if req_id in self.suspects:
                self.suspects.remove(req_id)
            log.error("request %s failed: %s", req_id, reason)
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
