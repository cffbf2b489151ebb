"""An exception while serving one request fails that request only; the rest stay exact."""

from __future__ import annotations

import msgspec
import pytest
from conftest_helpers import make_prompts

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_core(path, **overrides) -> EngineCore:
    kwargs = dict(model=str(path), dtype="float32", max_model_len=512, **overrides)
    return EngineCore(EngineConfig(**kwargs))


def run(core: EngineCore, prompts: dict[str, list[int]]) -> tuple[dict, dict]:
    """Serve every prompt to the end: (tokens by id, error by id)."""
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, GREEDY))
    tokens = {r: [] for r in prompts}
    errors = {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.error is not None:
                errors[out.request_id] = out.error
    assert not core.has_unfinished_requests()
    return tokens, errors


def assert_clean(core: EngineCore) -> None:
    assert core.kv.num_free_blocks() == core.num_blocks - 1, "KV blocks leaked"
    core.kv.pool.check_integrity()


@pytest.fixture(scope="module")
def reference(models):
    path = models.get("llama")
    prompts = {f"req-{i}": p for i, p in enumerate(make_prompts(6, seed=3))}
    tokens, errors = run(make_core(path), prompts)
    assert not errors
    return path, prompts, tokens


@pytest.mark.parametrize("stage", ["execute", "update"])
def test_a_fault_in_one_request_fails_it_alone_and_the_others_stay_exact(
    reference, monkeypatch, stage
):
    path, prompts, expected = reference
    core = make_core(path)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", f"{stage}:req-3")
    tokens, errors = run(core, prompts)
    assert list(errors) == ["req-3"] and "injected fault" in errors["req-3"]
    for req_id in prompts:
        if req_id != "req-3":
            assert tokens[req_id] == expected[req_id], req_id
    assert_clean(core)
    if stage == "execute":
        assert core.stats().failed_steps >= 1
        assert not core.guard.suspects and not core.guard.strikes


def test_blocks_named_in_a_failed_step_are_not_served_from_the_prefix_cache(reference, monkeypatch):
    """The failed step named the batch's blocks before their KV was written; later
    requests with the same prompts must recompute them, not read garbage."""
    path, prompts, expected = reference
    core = make_core(path)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:req-3")
    run(core, prompts)
    monkeypatch.delenv("EPDSERVE_INJECT_FAULT")
    again = {f"again-{r}": p for r, p in prompts.items()}
    tokens, errors = run(core, again)
    assert not errors
    assert {r[len("again-") :]: t for r, t in tokens.items()} == expected
    assert_clean(core)


def test_a_fault_with_preemption_and_chunked_prefill_keeps_the_others_exact(reference, monkeypatch):
    path, prompts, expected = reference
    core = make_core(path, max_num_batched_tokens=32, kv_cache_memory=40 * 4 * 2 * 16 * 2 * 32 * 4)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:req-1")
    tokens, errors = run(core, prompts)
    assert list(errors) == ["req-1"]
    assert all(tokens[r] == expected[r] for r in prompts if r != "req-1")
    assert_clean(core)


def test_a_lone_request_that_fails_is_failed_at_once(reference, monkeypatch):
    path, prompts, _ = reference
    core = make_core(path)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:req-0")
    tokens, errors = run(core, {"req-0": prompts["req-0"]})
    assert list(errors) == ["req-0"] and tokens["req-0"] == []
    assert core.stats().failed_steps == 1
    assert_clean(core)


def test_an_update_that_fails_after_its_request_finished_still_frees_it(reference, monkeypatch):
    """``make_output`` runs after the stop check: the request is finished, still running and
    holding blocks when it raises; failing it must free them."""
    from epdserve.engine.core import sched_utils as scheduler_module  # the update's helpers

    path, prompts, expected = reference
    real = scheduler_module.make_output

    def flaky(request, *args):
        if request.request_id == "req-2" and request.is_finished:
            raise RuntimeError("output construction failed")
        return real(request, *args)

    monkeypatch.setattr(scheduler_module, "make_output", flaky)
    core = make_core(path)
    tokens, errors = run(core, prompts)
    assert list(errors) == ["req-2"] and "output construction failed" in errors["req-2"]
    assert all(tokens[r] == expected[r] for r in prompts if r != "req-2")
    assert_clean(core)


def test_a_duplicate_request_id_is_refused_and_the_live_request_goes_on(reference):
    path, prompts, expected = reference
    core = make_core(path)
    core.add_request(EngineCoreRequest("req-0", prompts["req-0"], GREEDY))
    with pytest.raises(ValueError, match="request_id: 'req-0' is already in use"):
        core.add_request(EngineCoreRequest("req-0", prompts["req-1"], GREEDY))
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None
            tokens += out.new_token_ids
    assert tokens == expected["req-0"]
    assert_clean(core)


@pytest.mark.parametrize("by", ["id", "label"])
def test_a_fault_while_scheduling_one_request_fails_it_alone(reference, monkeypatch, by):
    """Injected where the scheduler looks at that request (the stage ``schedule``); the
    marker names the request's id or its label (the client's X-Request-Id)."""
    path, prompts, expected = reference
    core = make_core(path)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "schedule:poison")
    for req_id, ids in prompts.items():
        bad = req_id == "req-4"
        name = "poison-4" if bad and by == "id" else req_id
        label = "poison-label" if bad and by == "label" else None
        core.add_request(EngineCoreRequest(name, ids, GREEDY, label=label))
    tokens, errors = drain(core)
    culprit = "poison-4" if by == "id" else "req-4"
    assert list(errors) == [culprit] and "injected fault in stage schedule" in errors[culprit]
    for req_id in prompts:
        if req_id != "req-4":
            assert tokens[req_id] == expected[req_id], req_id
    assert core.stats().failed_steps == 1
    assert_clean(core)


def test_a_scheduling_fault_that_names_no_request_is_isolated_and_the_others_stay_exact(
    reference, monkeypatch
):
    """Building the step's output raises whenever ``req-2`` is in the batch: no one request
    is named, so the batch is struck and tried alone until ``req-2`` is found."""
    from epdserve.engine.core.scheduler import Scheduler

    path, prompts, expected = reference
    real = Scheduler._build_output

    def flaky(self, new_reqs, cached_reqs, new_block_ids, num_scheduled):
        if "req-2" in num_scheduled:
            raise RuntimeError("cannot build this batch")
        return real(self, new_reqs, cached_reqs, new_block_ids, num_scheduled)

    monkeypatch.setattr(Scheduler, "_build_output", flaky)
    core = make_core(path)
    tokens, errors = run(core, prompts)
    assert list(errors) == ["req-2"] and "cannot build this batch" in errors["req-2"]
    assert all(tokens[r] == expected[r] for r in prompts if r != "req-2")
    assert not core.guard.suspects and not core.guard.strikes
    assert_clean(core)


def test_a_scheduling_fault_after_the_batch_was_counted_leaves_no_block_named(
    reference, monkeypatch
):
    """The step raises after its requests' computed tokens were advanced and their new
    blocks named in the prefix cache; those blocks were never written, so the same prompts
    served afterwards must compute them, not read them."""
    from epdserve.engine.core.scheduler import Scheduler

    path, prompts, expected = reference
    real = Scheduler._build_output
    calls = {"n": 0}

    def late(self, *args):
        out = real(self, *args)
        calls["n"] += 1
        if calls["n"] == 1:  # the first (prefill) step: every prompt's blocks were named
            raise RuntimeError("late scheduling failure")
        return out

    monkeypatch.setattr(Scheduler, "_build_output", late)
    core = make_core(path)
    tokens, errors = run(core, prompts)
    assert all(tokens[r] == expected[r] for r in prompts if r not in errors)
    monkeypatch.setattr(Scheduler, "_build_output", real)
    again = {f"again-{r}": p for r, p in prompts.items()}
    tokens, errors = run(core, again)
    assert not errors
    assert {r[len("again-") :]: t for r, t in tokens.items()} == expected
    assert_clean(core)


def drain(core: EngineCore) -> tuple[dict, dict]:
    """Step until idle: (tokens by id, error by id) for requests already added."""
    tokens, errors = {r: [] for r in core.scheduler.requests}, {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.error is not None:
                errors[out.request_id] = out.error
    assert not core.has_unfinished_requests()
    return tokens, errors


class _Outputs:
    """Stands in for the core's PUSH socket: keeps every output sent."""

    def __init__(self):
        self.sent = []

    def send(self, data, copy=True) -> None:
        from epdserve.engine.core.interfaces import EngineCoreOutputs

        self.sent += msgspec.msgpack.decode(data, type=EngineCoreOutputs).outputs


@pytest.fixture
def core_loop(reference):
    import zmq

    from epdserve.engine.core.core_proc import CoreLoop

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    outputs = _Outputs()
    yield CoreLoop(make_core(reference[0]), pull, outputs), push, outputs
    ctx.destroy(linger=0)


def test_the_input_loop_answers_a_duplicate_add_with_an_error_and_keeps_the_first(
    reference, core_loop
):
    from epdserve.engine.core.core_proc import ADD

    _, prompts, expected = reference
    loop, _, outputs = core_loop
    encode = msgspec.msgpack.encode
    loop._handle(ADD, encode(EngineCoreRequest("req-0", prompts["req-0"], GREEDY)))
    loop._handle(ADD, encode(EngineCoreRequest("req-0", prompts["req-1"], GREEDY)))
    (refused,) = outputs.sent
    assert refused.error_status == 400 and "already in use" in refused.error
    tokens = []
    while loop.core.has_unfinished_requests():
        tokens += [t for o in loop.core.step() for t in o.new_token_ids]
    assert tokens == expected["req-0"]


def test_the_input_loop_survives_odd_frames_bad_payloads_and_failing_aborts(core_loop, monkeypatch):
    from epdserve.engine.core.core_proc import ABORT, ADD

    loop, push, outputs = core_loop
    push.send_multipart([ADD, b"x", b"y"])  # three frames
    push.send_multipart([ADD])  # one
    push.send_multipart([ADD, b"\xc1 not msgpack"])
    push.send_multipart([ABORT, msgspec.msgpack.encode(["nobody"])])

    def broken(ids):
        raise RuntimeError("abort failed")

    monkeypatch.setattr(loop.core, "abort_requests", broken)
    for _ in range(4):
        loop._drain_input(timeout_ms=1000)
    assert loop.rejected == 1 and outputs.sent == []  # no id to answer
