"""``--scheduling-policy priority``: the waiting order and the preemption victim, exactly
(no model: runner outputs are given); ``fcfs`` keeps arrival order and refuses priorities."""

from __future__ import annotations

import argparse

import pytest

from epdserve.common.cli_fields import from_args
from epdserve.engine.config import EngineConfig
from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, none_hash
from epdserve.engine.core.interfaces import ModelRunnerOutput
from epdserve.engine.core.kv_cache_manager import KVCacheManager
from epdserve.engine.core.request import Request, RequestStatus
from epdserve.engine.core.scheduler import Scheduler
from epdserve.engine.core.waiting_queue import PriorityQueue, victim_index
from epdserve.engine.entrypoints import serve_cli
from epdserve.engine.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_scheduler(policy="priority", num_blocks=20, max_num_seqs=8):
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, 64, 64, policy=policy)


def make_request(req_id, n_tokens, priority=0, arrival=None, first=10, max_tokens=20):
    fn = get_hash_fn("sha256_cbor")
    tokens = list(range(first, first + n_tokens))
    params = SamplingParams(max_tokens=max_tokens)
    hasher = BlockHasher(BS, fn, none_hash(fn, "s"))
    return Request(req_id, tokens, params, EOS, hasher, arrival, priority=priority)


def run_step(sched, token=7):
    """Schedule, then sample ``token`` for every request that reached its end."""
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [token] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
        for r in req_ids
    ]
    sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled))
    return out


def test_the_priority_queue_pops_by_priority_then_arrival_with_put_first_ahead():
    q = PriorityQueue()
    reqs = {
        "late-high": make_request("late-high", 4, priority=-1, arrival=5.0),
        "early-low": make_request("early-low", 4, priority=3, arrival=1.0),
        "early-mid": make_request("early-mid", 4, priority=0, arrival=2.0),
        "later-mid": make_request("later-mid", 4, priority=0, arrival=3.0),
    }
    for name in ("later-mid", "early-low", "late-high", "early-mid"):
        q.append(reqs[name])
    q.appendleft(make_request("preempted-low", 4, priority=3, arrival=0.5))  # by key too
    solo = make_request("solo", 4, priority=9, arrival=9.0)
    q.put_first([solo])
    order = ["solo", "late-high", "early-mid", "later-mid", "preempted-low", "early-low"]
    assert [r.request_id for r in q] == order and q[0] is solo and len(q) == 6
    q.remove(reqs["early-mid"])
    assert reqs["early-mid"] not in q and reqs["later-mid"] in q
    assert [q.popleft().request_id for _ in range(len(q))] == [n for n in order if n != "early-mid"]
    assert not q
    with pytest.raises(IndexError):
        q.popleft()


def test_the_victim_is_the_largest_priority_then_the_latest_arrival():
    running = [
        make_request("a", 4, priority=5, arrival=1.0),
        make_request("b", 4, priority=9, arrival=2.0),
        make_request("c", 4, priority=9, arrival=3.0),
        make_request("d", 4, priority=0, arrival=4.0),
    ]
    assert victim_index(running, "priority") == 2
    assert victim_index(running, "fcfs") == 3


def test_waiting_requests_start_by_priority_not_arrival():
    s = make_scheduler(max_num_seqs=1)
    for name, priority in (("low-1", 5), ("low-2", 5), ("high", -2), ("mid", 0)):
        s.add_request(make_request(name, 4, priority, first=10 * len(s.requests) + 10))
    admitted = []
    while s.has_unfinished_requests():
        out = run_step(s)
        admitted += [r.req_id for r in out.scheduled_new_reqs]
    assert admitted == ["high", "mid", "low-1", "low-2"]


def test_fcfs_starts_in_arrival_order_and_refuses_a_priority_naming_it():
    s = make_scheduler("fcfs", max_num_seqs=1)
    for i, name in enumerate(("a", "b", "c")):
        s.add_request(make_request(name, 4, first=10 * i + 10))
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="^priority:"):
        s.add_request(make_request("d", 4, priority=1, first=90))
    assert "d" not in s.requests and len(s.waiting) == 3


def test_a_high_priority_arrival_waits_for_running_requests_instead_of_preempting_them():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("low", 4, priority=9, max_tokens=3))
    run_step(s)
    s.add_request(make_request("other-low", 4, priority=9, first=50))
    s.add_request(make_request("high", 4, priority=0, first=90))
    out = run_step(s)
    assert out.num_scheduled_tokens == {"low": 1} and s.num_preemptions == 0
    assert [r.request_id for r in s.waiting] == ["high", "other-low"]
    run_step(s)  # low's third and last token
    out = run_step(s)
    assert out.num_scheduled_tokens == {"high": 4}


def grow_three(policy):
    """a(5), b(9), c(0) run in that order on 6 blocks, 2 each; a then needs a 3rd."""
    s = make_scheduler(policy, num_blocks=7)
    s.add_request(make_request("a", 5, priority=5 if policy == "priority" else 0))
    run_step(s)
    s.add_request(make_request("b", 5, priority=9 if policy == "priority" else 0, first=50))
    run_step(s)
    s.add_request(make_request("c", 5, priority=0, first=90))
    run_step(s)
    run_step(s)
    assert [r.request_id for r in s.running] == [
        "a",
        "b",
        "c",
    ] and s.kv.pool.get_num_free_blocks() == 0
    return s, run_step(s)  # a computes its 9th token: a new block, none free


def test_priority_preempts_the_largest_priority_value_not_the_last_running():
    s, out = grow_three("priority")
    assert out.num_scheduled_tokens == {"a": 1, "c": 1} and out.finished_req_ids == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in s.running] == ["a", "c"] and list(s.waiting) == [b]
    s.kv.pool.check_integrity()


def test_fcfs_still_preempts_the_last_running_request():
    s, out = grow_three("fcfs")
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.finished_req_ids == ["c"]
    assert [r.request_id for r in s.running] == ["a", "b"] and s.waiting[0].request_id == "c"


def test_a_victim_scheduled_earlier_in_the_step_is_unscheduled_and_its_budget_returned():
    s = make_scheduler(num_blocks=4)  # 3 blocks
    s.add_request(make_request("b", 5, priority=9))
    run_step(s)  # b = 2 blocks
    s.add_request(make_request("a", 4, priority=1, first=50))
    run_step(s)  # a = 1 block; b computed 6
    out = run_step(s)  # b is scheduled first, then a needs a 2nd block: b goes
    assert out.num_scheduled_tokens == {"a": 1} and out.total_num_scheduled_tokens == 1
    assert out.scheduled_cached_reqs.req_ids == ["a"] and out.finished_req_ids == ["b"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    assert [r.request_id for r in s.running] == ["a"]
    s.kv.pool.check_integrity()


def test_a_preempted_request_goes_back_by_its_priority_not_to_the_head():
    s, _ = grow_three("priority")  # b (9) was preempted
    s.add_request(make_request("d", 4, priority=7, first=130))
    assert [r.request_id for r in s.waiting] == ["d", "b"]


def test_a_solo_run_admits_its_request_ahead_of_higher_priorities():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("high", 4, priority=-5))
    s.add_request(make_request("low", 4, priority=5, first=50))
    s.run_solo("low")
    assert s.schedule().num_scheduled_tokens == {"low": 4}


def test_the_policy_is_a_serve_flag_and_an_engine_setting_checked_by_name():
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["m", "--device", "cpu", "--scheduling-policy", "priority"])
    assert from_args(EngineConfig, args).scheduling_policy == "priority"
    assert EngineConfig(model="m", device="cpu").scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="^scheduling_policy: must be fcfs or priority"):
        EngineConfig(model="m", device="cpu", scheduling_policy="lifo")


def test_offline_generate_takes_a_priority_per_prompt_and_serves_lower_first(models, monkeypatch):
    from epdserve.engine import LLM

    llm = LLM(
        str(models.get("llama")), max_model_len=256, max_num_seqs=1, scheduling_policy="priority"
    )
    finished, step = [], llm.engine.step

    def spy():  # the core's outputs, passed on; the finished ones recorded in order
        outputs = step()
        finished.extend(o for o in outputs if o.finish_reason)
        return outputs

    monkeypatch.setattr(llm.engine, "step", spy)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    out = llm.generate(["a", "b", "c"], params, priority=[5, -1, 9])
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3, 3]  # in prompt order
    by_id = {o.request_id: i for i, o in enumerate(out)}
    assert [by_id[o.request_id] for o in finished] == [1, 0, 2]
    for bad, message in ((True, "64-bit"), (1.5, "64-bit"), ([1], "one entry per prompt")):
        with pytest.raises(ValueError, match=f"^priority: .*{message}"):
            llm.generate(["a", "b"], params, priority=bad)
    monkeypatch.setattr(llm, "config", EngineConfig(model=llm.config.model, device="cpu"))
    with pytest.raises(ValueError, match="^priority: 3 needs scheduling_policy='priority'"):
        llm.generate(["a"], params, priority=3)
