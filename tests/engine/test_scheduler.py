"""Exact-state tests of the token-budget scheduler (no model: runner outputs are given)."""

from __future__ import annotations

import pytest

from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, none_hash
from epdserve.engine.core.interfaces import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from epdserve.engine.core.kv_cache_manager import KVCacheManager
from epdserve.engine.core.mm_scheduling import EncoderScheduler
from epdserve.engine.core.request import Request, RequestStatus
from epdserve.engine.core.request_queues import UndoneSchedule
from epdserve.engine.core.scheduler import Scheduler
from epdserve.engine.core.step_guard import InjectedFault
from epdserve.engine.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_scheduler(num_blocks=20, max_num_seqs=8, budget=64, max_model_len=64, caching=True):
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len)


def make_request(req_id, n_tokens, max_tokens=4, first=10, **params):
    fn = get_hash_fn("sha256_cbor")
    tokens = list(range(first, first + n_tokens))
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=max_tokens, **params),
        EOS,
        BlockHasher(BS, fn, none_hash(fn, "s")),
    )


def run_step(sched, token=7):
    """Schedule, then sample ``token`` for every request that reached its end."""
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [token] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
        for r in req_ids
    ]
    return out, sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled))


def test_new_requests_are_scheduled_whole_within_the_budget():
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 6, first=50))
    out, outputs = run_step(s)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[[1, 2, 3]], [[4, 5]]]
    assert [o.new_token_ids for o in outputs] == [[7], [7]]


def test_long_prompt_is_chunked_and_samples_only_at_its_end():
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 20))
    chunks = []
    for _ in range(3):
        out, outputs = run_step(s)
        chunks.append((out.num_scheduled_tokens["a"], [o.new_token_ids for o in outputs]))
    assert chunks == [(8, []), (8, []), (4, [[7]])]


def test_running_requests_are_served_before_waiting_ones():
    s = make_scheduler(budget=12)
    s.add_request(make_request("a", 10))
    run_step(s)
    s.add_request(make_request("b", 20, first=50))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 11)]
    assert out.scheduled_cached_reqs.req_ids == ["a"]


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2)
    for i, name in enumerate("abc"):
        s.add_request(make_request(name, 4, first=10 * i))
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"} and s.num_waiting() == 1


def test_preemption_frees_the_last_running_request_and_requeues_it_first():
    s = make_scheduler(num_blocks=5)
    s.add_request(make_request("a", 8, max_tokens=8))
    s.add_request(make_request("b", 8, max_tokens=8, first=50))
    run_step(s)  # 4 blocks used: a=[1,2], b=[3,4]
    out, _ = run_step(s)  # each needs a 3rd block: b is preempted for a
    assert list(out.num_scheduled_tokens) == ["a"]
    assert "b" in out.finished_req_ids
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and s.num_preemptions == 1
    s.kv.pool.check_integrity()


def test_finished_requests_free_their_blocks_and_are_reported_to_the_runner():
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=2))
    run_step(s)
    _, outputs = run_step(s)
    assert outputs[-1].finish_reason == "length"
    assert s.kv.num_free_blocks() == 19
    out = s.schedule()
    assert out.finished_req_ids == ["a"]


def test_eos_stops_only_after_min_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=10, min_tokens=2))
    _, o1 = run_step(s, token=EOS)
    _, o2 = run_step(s, token=EOS)
    assert o1[0].finish_reason is None and o2[0].finish_reason == "stop"


def test_stop_token_ids_finish_with_that_token_as_stop_reason():
    s = make_scheduler()
    s.add_request(make_request("a", 5, stop_token_ids=[7]))
    _, outputs = run_step(s, token=7)
    assert (outputs[0].finish_reason, outputs[0].stop_reason) == ("stop", 7)


def test_abort_frees_a_waiting_or_running_request():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    s.add_request(make_request("b", 5, first=40))
    run_step(s)
    s.add_request(make_request("c", 5, first=80))
    done = s.finish_requests(["a", "c"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a", "c"]
    assert s.num_running() == 1 and s.num_waiting() == 0
    assert s.kv.num_free_blocks() == 19 - 2


def test_second_request_with_shared_prefix_reports_cached_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", 13))
    run_step(s)
    s.add_request(make_request("b", 13))
    out, outputs = run_step(s)
    assert out.num_scheduled_tokens["b"] == 1
    assert outputs[-1].num_cached_tokens == 12


# --- the step guard's methods: rollback(), undo_schedule(), run_solo() ---------------------
def test_rollback_preempts_the_batch_and_unnames_only_the_blocks_named_that_step():
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    s.add_request(make_request("c", 4, first=90))
    run_step(s)  # a = [1, 2, 3] (1 and 2 computed and named), c = [4]
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    s.add_request(make_request("b", 6, first=50))
    failed = s.schedule()  # a: one token; b: [5, 6], 5 named before its KV is written
    assert failed.num_scheduled_tokens == {"a": 1, "b": 6} and failed.finished_req_ids == ["c"]
    a, b, pool = s.requests["a"], s.requests["b"], s.kv.pool
    assert s.rollback(failed) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["b", "a"] and not s.running
    assert (a.status, a.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert (b.status, b.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert [pool.get_cached_block(h).block_id for h in a.block_hashes] == [1, 2]
    assert pool.get_cached_block(b.block_hashes[0]) is None
    assert s.kv.num_free_blocks() == 19
    assert all(pool.get_cached_block(h).ref_cnt == 0 for h in a.block_hashes)
    pool.check_integrity()
    again = s.schedule()  # c is told again, with the preempted pair
    assert again.finished_req_ids == ["a", "b", "c"]
    assert again.num_scheduled_tokens == {"b": 6, "a": 3}
    assert [(r.block_ids, r.num_computed_tokens) for r in again.scheduled_new_reqs] == [
        ([[7, 8]], 0),
        ([[1, 2, 9]], 8),  # a's computed prefix is still served from the cache
    ]


def test_rollback_tells_the_runner_the_failed_steps_freed_encoder_outputs_once():
    kv = KVCacheManager(20, BS)
    s = Scheduler(kv, 8, 64, 64, encoder=EncoderScheduler(cache_tokens=64, budget_tokens=64))
    failed = SchedulerOutput([], CachedRequestData([], [], []), {}, 0, ["gone"])
    failed.free_encoder_ids = ["img-1"]
    assert s.rollback(failed) == []
    out = s.schedule()
    assert (out.finished_req_ids, out.free_encoder_ids) == (["gone"], ["img-1"])
    out = s.schedule()
    assert (out.finished_req_ids, out.free_encoder_ids) == ([], [])


def test_undo_schedule_names_the_request_it_was_handling_and_requeues_everyone(monkeypatch):
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    run_step(s)
    s.add_request(make_request("b", 6, first=50))
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "schedule:b")
    with pytest.raises(InjectedFault):
        s.schedule()  # a was scheduled, then b raised
    assert s.undo_schedule() == UndoneSchedule("b", ["a"])
    a = s.requests["a"]
    assert [r.request_id for r in s.waiting] == ["a", "b"] and not s.running
    assert (a.status, a.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert s.kv.num_free_blocks() == 19
    s.kv.pool.check_integrity()
    monkeypatch.delenv("EPDSERVE_INJECT_FAULT")
    out = s.schedule()
    assert out.finished_req_ids == ["a"] and out.num_scheduled_tokens == {"a": 3, "b": 6}


def test_run_solo_admits_only_that_request_and_preempts_the_last_running_for_its_blocks():
    s = make_scheduler(num_blocks=5)
    s.add_request(make_request("a", 8, max_tokens=8))
    s.add_request(make_request("b", 8, max_tokens=8, first=50))
    run_step(s)  # a = [1, 2], b = [3, 4]: no block left
    s.add_request(make_request("c", 4, first=90))
    s.run_solo("c")
    out = s.schedule()
    assert out.num_scheduled_tokens == {"c": 4} and out.finished_req_ids == ["b"]
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[[4]]]  # b's, freed tail first
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in s.running] == ["a", "c"] and s.requests[
        "a"
    ].num_computed_tokens == 8
    assert s.schedule().num_scheduled_tokens == {}  # still solo: a waits, c is computed
    s.run_solo(None)
    assert s.schedule().num_scheduled_tokens == {"a": 1}


def test_run_solo_schedules_only_that_running_request():
    s = make_scheduler()
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 6, first=50))
    run_step(s)
    s.run_solo("b")
    assert s.schedule().num_scheduled_tokens == {"b": 1}
