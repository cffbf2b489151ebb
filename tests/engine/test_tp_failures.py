"""A rank that dies, hangs or raises (DESIGN.md §10): detected in bounded time. A fault every
rank meets at the same point is contained as any step fault (its request fails alone, the
others stay exact); a dead, hung or out-of-step rank ends the core with ``WorkerFailure``."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest_helpers import make_prompts
from test_step_guard import GREEDY, assert_clean, make_core, run

from epdserve.engine.core.engine_core import EngineCoreRequest
from epdserve.engine.executor.rank_messages import WorkerFailure


def step_until_failure(core, limit_s: float) -> float:
    """Step until the executor gives up; how long that took."""
    start = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        while time.monotonic() - start < limit_s:
            core.step()
    print(info.value)
    return time.monotonic() - start


def started(core, prompts) -> None:
    for i, ids in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", ids, GREEDY))
    for _ in range(3):
        core.step()


@pytest.fixture
def llama(models):
    return models.get("llama")


def test_a_fault_every_rank_meets_fails_its_request_alone(llama, monkeypatch):
    prompts = make_prompts(4)
    reference, _ = run(make_core(llama), {f"ok{i}": p for i, p in enumerate(prompts)})
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "ranks:poison")
    core = make_core(llama, tensor_parallel_size=2)
    try:
        ids = {f"ok{i}": p for i, p in enumerate(prompts)} | {"poison": prompts[0]}
        tokens, errors = run(core, ids)
        assert set(errors) == {"poison"} and "injected fault" in errors["poison"]
        assert {r: tokens[r] for r in reference} == reference
        assert_clean(core)
    finally:
        core.close()


@pytest.mark.parametrize(
    "fault", ["kill", "stop", "one-rank-raises"], ids=["dies", "hangs", "raises-alone"]
)
def test_a_dead_hung_or_out_of_step_rank_ends_the_core_in_bounded_time(llama, monkeypatch, fault):
    monkeypatch.setenv("EPDSERVE_STEP_TIMEOUT_S", "4")
    if fault == "one-rank-raises":  # rank 1 skips the step; rank 0 waits in a collective
        monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "rank1:r1")
    core = make_core(llama, tensor_parallel_size=2)
    procs = core.executor.procs
    try:
        if fault == "one-rank-raises":
            elapsed = step_until_failure_after_add(core)
        else:
            started(core, make_prompts(2))
            os.kill(procs[1].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            elapsed = step_until_failure(core, 30)
        assert elapsed < {"kill": 2, "stop": 8, "one-rank-raises": 8}[fault]
    finally:
        t = time.monotonic()
        core.close()  # a hung or dead rank is killed: no wait on it
        assert time.monotonic() - t < 10
    assert all(p.poll() is not None for p in procs)


def step_until_failure_after_add(core) -> float:
    core.add_request(EngineCoreRequest("r1", make_prompts(1)[0], GREEDY))
    return step_until_failure(core, 30)
