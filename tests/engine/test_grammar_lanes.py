"""Grammar compiles under load (issue #41): cheap specs in their own lane, clients served in
turn, and compiles nobody waits for dropped before they start."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.structured import StructuredOutputsParams as SO
from epdserve.engine.structured import manager as manager_mod
from epdserve.engine.structured.compile_queue import CompileJob, CompileLane, FairQueue


class Waiter:
    def __init__(self, finished: bool = False):
        self.is_finished = finished


def large_schema(tag: str) -> dict:
    """120 optional properties: past the cheap lane's bound, far below the API's."""
    props = {f"{tag}{i}": {"type": "integer"} for i in range(120)}
    return {"type": "object", "properties": props}


def test_a_fair_queue_takes_one_job_per_client_in_turn():
    queue = FairQueue()
    for name, client in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C")]:
        queue.put(CompileJob(name, client, Waiter()))
    order = [queue.take().params for _ in range(5)]
    assert order == ["a1", "b1", "c1", "a2", "a3"] and queue.take() is None


def test_a_client_arriving_later_goes_before_the_others_second_jobs():
    queue = FairQueue()
    for name in ("a1", "a2", "a3"):
        queue.put(CompileJob(name, "A", Waiter()))
    assert queue.take().params == "a1"  # A is served; then B comes
    queue.put(CompileJob("b1", "B", Waiter()))
    assert [queue.take().params for _ in range(3)] == ["b1", "a2", "a3"]


def test_a_lane_drops_a_job_whose_requests_are_gone_and_compiles_the_next():
    gate, compiled = threading.Event(), []

    def compile_fn(params):
        gate.wait(10)
        compiled.append(params)
        return params

    lane = CompileLane("large", compile_fn, threading.Lock())
    first, gone, live = (CompileJob(n, "A", Waiter(n == "gone")) for n in ("first", "gone", "live"))
    with lane.lock:
        for job in (first, gone, live):
            lane.put(job)
    gate.set()
    assert live.future.result(10) == "live"
    assert compiled == ["first", "live"] and gone.future.cancelled() and lane.dropped == 1
    lane.close()


def test_closing_a_lane_cancels_what_is_queued():
    lane = CompileLane("large", lambda p: p, threading.Lock())
    lane.close()
    job = CompileJob("x", "A", Waiter())
    with lane.lock:
        lane.put(job)
    lane.close()
    assert job.future.cancelled()


@pytest.fixture
def gated_core(models, monkeypatch):
    """An engine core whose JSON compiles wait for ``gate`` and record their order."""
    gate, order = threading.Event(), []
    real = manager_mod.StructuredOutputManager._compile

    def gated(self, params):
        if params.kind == "json":
            gate.wait(30)
            order.append(next(iter(params.json["properties"]))[:-1])  # the schema's tag
        return real(self, params)

    monkeypatch.setattr(manager_mod.StructuredOutputManager, "_compile", gated)
    from epdserve.engine.config import EngineConfig

    core = EngineCore(EngineConfig(model=str(models.get("llama")), max_num_seqs=8))
    yield core, gate, order
    gate.set()
    core.close()


def add(core, req_id, spec, client=None, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=spec)
    core.add_request(EngineCoreRequest(req_id, [5, 6, 7, 8], params, client=client))


def run_until(core, outs, done, steps=400):
    for _ in range(steps):
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
        if done():
            return
    raise AssertionError(f"not done after {steps} steps: {sorted(outs)}")


def finished(outs, req_id) -> bool:
    return req_id in outs and outs[req_id][-1].finish_reason is not None


def test_a_choice_is_answered_while_large_schemas_wait_to_compile(gated_core):
    core, gate, _ = gated_core
    for i in range(4):
        add(core, f"big{i}", SO(json=large_schema(f"s{i}p")))
    add(core, "choice", SO(choice=["yes", "no"]), max_tokens=8)
    outs: dict = {}
    run_until(core, outs, lambda: finished(outs, "choice"))
    assert outs["choice"][-1].finish_reason == "stop"
    assert not any(f"big{i}" in outs for i in range(4))  # still compiling or queued
    gate.set()
    run_until(core, outs, lambda: not core.has_unfinished_requests())
    assert all(outs[f"big{i}"][-1].finish_reason in ("stop", "length") for i in range(4))


def test_large_compiles_take_turns_by_client(gated_core):
    core, gate, order = gated_core
    for i in range(3):
        add(core, f"a{i}", SO(json=large_schema(f"a{i}p")), client="10.0.0.1")
    add(core, "b0", SO(json=large_schema("b0p")), client="10.0.0.2")
    gate.set()
    outs: dict = {}
    run_until(core, outs, lambda: not core.has_unfinished_requests())
    assert order == ["a0p", "b0p", "a1p", "a2p"]  # b0 came last but compiles second


def test_an_aborted_requests_queued_compile_never_runs(gated_core):
    core, gate, order = gated_core
    add(core, "first", SO(json=large_schema("firstp")))
    add(core, "aborted", SO(json=large_schema("abortedp")))
    core.abort_requests(["aborted"])
    gate.set()
    outs: dict = {}
    run_until(core, outs, lambda: not core.has_unfinished_requests())
    assert order == ["firstp"] and core.structured.dropped == 1


def test_a_spec_dropped_from_the_queue_is_compiled_again_when_asked_again(gated_core):
    core, gate, order = gated_core
    add(core, "first", SO(json=large_schema("firstp")))
    add(core, "aborted", SO(json=large_schema("againp")))
    core.abort_requests(["aborted"])
    gate.set()
    outs: dict = {}
    run_until(core, outs, lambda: not core.has_unfinished_requests())
    add(core, "again", SO(json=large_schema("againp")))
    run_until(core, outs, lambda: not core.has_unfinished_requests())
    assert order == ["firstp", "againp"] and outs["again"][-1].finish_reason in ("stop", "length")


def test_cheap_specs_take_the_small_lane_and_large_schemas_the_other():
    small = [SO(choice=["a", "b"]), SO(regex="[a-z]{1,8}"), SO(json_object=True)]
    small.append(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert all(manager_mod.is_small(s) for s in small)
    assert not manager_mod.is_small(SO(json=large_schema("p")))
    assert not manager_mod.is_small(SO(choice=[f"choice {i}" for i in range(1000)]))  # > 4 KB


def test_a_future_cancelled_by_close_fails_its_request_with_a_value_error():
    future = Future()
    future.cancel()
    state = manager_mod.GrammarState(future, deadline=1e18, field="structured_outputs.json")
    with pytest.raises(ValueError, match="structured_outputs.json: .*cancelled"):
        state.ready()
