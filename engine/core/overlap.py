"""Overlapped scheduling (vLLM's ``--async-scheduling``): the core schedules step N+1 while
the device runs step N, and applies N's output (stop checks, outputs) while N+1 runs.

One step at a time runs on the executor. Each ``step()``: schedule N+1 (N in flight), wait
for N, start N+1, then apply N's output. The runner keeps every request's tokens itself, so
N+1 needs nothing of N's output: a request that samples in a step holds a *placeholder*
(``Request.num_output_placeholders``) until its token comes, and the scheduler gives it its
next token against it. What N's output changes is applied one step late, and kept exact:

- a request that stopped at N (EOS, stop token, a stop string's abort) but was scheduled in
  N+1: N+1's token is dropped (its row names no live request, or another request now), and
  its blocks and runner row are freed once, when N's output finishes it;
- a request whose tokens in flight reach ``max_tokens`` or ``max_model_len`` is not
  scheduled past them;
- no request is preempted while a step is in flight: a schedule that runs out of blocks
  stops there (``preemption_deferred``), and the next one waits for the step first.

The next schedule waits for the step in flight first (no overlap for that step) when that
step sampled under a grammar (the next bitmask needs its token), encoded or loaded images,
or wanted to preempt, and when nothing else is left to run. Steps of a failed batch's solo
reruns (the step guard) run as before overlap (``EngineCore.sync_step``). LoRA slot loads are
sent between steps, after the one in flight is done. A KV connector (P/D) turns overlap off:
its loads and saves are applied in turn, as before.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

from epdserve.engine.core.interfaces import EngineCoreOutput, SchedulerOutput
from epdserve.engine.core.step_guard import maybe_fail
from epdserve.engine.executor.rank_messages import WorkerFailure
from epdserve.engine.lora import core_side as lora_core

if TYPE_CHECKING:
    from epdserve.engine.core.engine_core import EngineCore

IDLE_POLL_S = 0.001


class InFlight(NamedTuple):
    sched: SchedulerOutput
    handle: Any  # the executor's: ``result()``, ``cpu_seconds``
    owners: list  # its requests, in batch order (a reused id is not theirs)
    wait_after: bool  # the next schedule needs its output first


class OverlappedSteps:
    """The engine core's step when ``async_scheduling`` is on."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.inflight: InFlight | None = None
        self.num_overlapped = 0  # steps scheduled while another ran
        core.scheduler.overlapped = True

    def step(self) -> list[EngineCoreOutput]:
        core, scheduler = self.core, self.core.scheduler
        outputs: list[EngineCoreOutput] = []
        prev = self.inflight
        if prev is not None and (
            prev.wait_after
            or scheduler.preemption_deferred
            or core.guard.suspects
            or not scheduler.has_unfinished_requests()
        ):
            outputs += self._finish(prev)
            prev = None
        if not scheduler.has_unfinished_requests():
            return outputs
        if core.guard.suspects:  # a failed batch's requests rerun alone, in turn
            return outputs + core.sync_step()
        core.guard.choose_solo(scheduler)
        scheduler.step_in_flight = prev is not None
        try:
            sched = scheduler.schedule()
        except Exception as exc:
            return outputs + self._schedule_failed(prev, exc)
        finally:
            scheduler.step_in_flight = False
        if prev is not None:
            self.num_overlapped += 1
        try:
            core.structured.fill(sched, scheduler.requests)
            maybe_fail("execute", sched.num_scheduled_tokens, scheduler.label_of)
        except Exception as exc:  # the step never starts: rolled back like a failed one
            return outputs + self._not_started(prev, sched, exc)
        if prev is not None:
            result, failed = _wait(prev)
            if failed is not None:  # N failed: N+1 never starts, both are rolled back
                self.inflight = None
                return outputs + self._contain(merged(prev.sched, sched), failed)
        self.inflight = None
        if not sched.total_num_scheduled_tokens:  # nothing to overlap: it runs in turn
            if prev is not None:
                outputs += self._apply(prev, result)
            else:
                time.sleep(IDLE_POLL_S)  # e.g. grammars compiling: poll, don't spin
            return outputs + self._run_now(sched)
        try:
            if core.lora is not None and core.lora.slot_ops:  # no step runs now
                lora_core.send_slot_ops(core.lora, core.executor)
            handle = core.executor.execute_model_async(sched)
        except WorkerFailure:
            raise
        except Exception as exc:  # rolled back first: the outputs below may finish its rows
            outputs += self._contain(sched, exc)
            return outputs + (self._apply(prev, result) if prev is not None else [])
        owners = [scheduler.requests[r] for r in sched.num_scheduled_tokens]
        wait_after = bool(
            sched.grammar_req_ids
            or sched.scheduled_encoder_inputs
            or sched.encoder_loads
            or any(r.grammar is not None for r in owners)
        )
        self.inflight = InFlight(sched, handle, owners, wait_after)
        if prev is not None:
            outputs += self._apply(prev, result)
        return outputs

    def drain(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight, if any, and apply its output."""
        return self._finish(self.inflight) if self.inflight is not None else []

    # --- helpers ---------------------------------------------------------------------
    def _finish(self, prev: InFlight) -> list[EngineCoreOutput]:
        self.inflight = None
        result, failed = _wait(prev)
        if failed is not None:
            return self._contain(prev.sched, failed)
        return self._apply(prev, result)

    def _apply(self, prev: InFlight, result) -> list[EngineCoreOutput]:
        self.core.model_cpu_seconds += prev.handle.cpu_seconds
        return self.core.apply_output(prev.sched, result, prev.owners)

    def _contain(self, sched: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        self.core.take_worker_stats(getattr(exc, "worker_stats", None))
        return self.core.guard.contain(self.core.scheduler, sched, exc)

    def _run_now(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """A step with no tokens (finished requests to tell the runner): run in turn."""
        core = self.core
        try:
            handle = core.executor.execute_model_async(sched)
            result = handle.result()
        except WorkerFailure:
            raise
        except Exception as exc:
            return self._contain(sched, exc)
        core.model_cpu_seconds += handle.cpu_seconds
        return core.apply_output(sched, result)

    def _not_started(self, prev: InFlight | None, sched: SchedulerOutput, exc: Exception):
        """``sched`` failed before it started: once the step in flight is done (its KV
        written), ``sched`` is rolled back (its requests are recomputed, the tokens in
        flight kept) and that step's output applied; if it failed too, both roll back."""
        if prev is None:
            return self._contain(sched, exc)
        self.inflight = None
        result, failed = _wait(prev)
        if failed is not None:
            return self._contain(merged(prev.sched, sched), failed)
        return self._contain(sched, exc) + self._apply(prev, result)

    def _schedule_failed(self, prev: InFlight | None, exc: Exception):
        """``schedule()`` raised: once the step in flight is done (its KV written), the
        schedule is undone as before overlap, then that step's output is applied (the tokens
        of requests the undo preempted are kept: recomputed with them)."""
        core = self.core
        if prev is None:
            return core.guard.contain_schedule(core.scheduler, exc)
        self.inflight = None
        result, failed = _wait(prev)
        outputs = core.guard.contain_schedule(core.scheduler, exc)
        if failed is not None:  # both failed: nothing left running to blame, the core ends
            return outputs + self._contain(prev.sched, failed)
        return outputs + self._apply(prev, result)


def _wait(step: InFlight) -> tuple[Any, Exception | None]:
    """The step's output, or what it raised (a ``WorkerFailure`` ends the core: raised)."""
    try:
        return step.handle.result(), None
    except WorkerFailure:
        raise
    except Exception as exc:
        return None, exc


def merged(first: SchedulerOutput, second: SchedulerOutput) -> SchedulerOutput:
    """Two consecutive steps as one, for a rollback of both: tokens per request summed, the
    runner's frees of both."""
    counts = dict(first.num_scheduled_tokens)
    for req_id, n in second.num_scheduled_tokens.items():
        counts[req_id] = counts.get(req_id, 0) + n
    return SchedulerOutput(
        [],
        second.scheduled_cached_reqs,
        counts,
        sum(counts.values()),
        sorted(set(first.finished_req_ids) | set(second.finished_req_ids)),
        free_encoder_ids=first.free_encoder_ids + second.free_encoder_ids,
    )
