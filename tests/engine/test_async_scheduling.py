"""Overlapped scheduling (``async_scheduling``, engine/core/overlap.py): with it on, every
output is token-for-token what the engine gives with it off (greedy and seeded; stops of every
kind, length caps, aborts, preemption, grammars, LoRA, tensor parallelism), no block leaks,
and steps really overlap (the next schedule comes before the last step's update)."""

from __future__ import annotations

import json
import random
import re

import pytest
from conftest_helpers import assert_no_leak

from epdserve.engine import LLM, LoRARequest, SamplingParams
from epdserve.engine.core.interfaces import EngineCoreRequest
from epdserve.engine.lora.random_adapters import write_random_adapters
from epdserve.engine.structured import StructuredOutputsParams as SO

BLOCK_BYTES_TINY = 4 * 2 * 16 * 2 * 32 * 4  # tiny llama, fp32, 16-token blocks
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def llama(models):
    return str(models.get("llama"))


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 4000) for _ in range(20)]
    out = []
    for i in range(n):
        body = [rng.randrange(10, 4000) for _ in range(3 + (i * 37) % 50)]
        out.append({"prompt_token_ids": prefix + body if i % 3 == 0 else body})
    return out


def both(llama, batch, params, **kwargs):
    """The outputs with overlap off and on (same engine settings), and the 'on' engine."""
    results, gen = {}, kwargs.pop("gen", {})
    for flag in (False, True):
        llm = LLM(model=llama, dtype="float32", block_size=16, async_scheduling=flag, **kwargs)
        outs = llm.generate(batch, params, **gen)
        results[flag] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                         for o in outs]  # fmt: skip
        assert_no_leak(llm)
        assert (llm.engine.overlap is not None) == flag
    return results[False], results[True], llm


def test_mixed_batch_greedy_identical_with_every_kind_of_stop(llama):
    batch = prompts(10) + [{"prompt_token_ids": list(range(100, 220))}]  # ends at max_model_len
    free = [SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY) for _ in batch]
    ref = LLM(model=llama, dtype="float32", block_size=16, max_model_len=128)
    seen = [o.outputs[0] for o in ref.generate(batch, free)]
    params = []
    for i, out in enumerate(seen[:-1]):
        kind = i % 5
        if kind == 0:  # a stop token sampled midway
            params.append(
                SamplingParams(max_tokens=24, stop_token_ids=[out.token_ids[5]], **GREEDY)
            )
        elif kind == 1 and len(out.text) > 6:  # a stop string (the frontend aborts it)
            params.append(SamplingParams(max_tokens=24, stop=[out.text[3:6]], **GREEDY))
        elif kind == 2:  # EOS, made certain by a bias once min_tokens are out
            eos = ref.engine.eos_token_ids[0]
            params.append(SamplingParams(max_tokens=24, min_tokens=3, logit_bias={eos: 100.0},
                                         **GREEDY))  # fmt: skip
        elif kind == 3:
            params.append(SamplingParams(max_tokens=1 + i, ignore_eos=True, **GREEDY))
        else:
            params.append(SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))
    params.append(SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))
    off, on, llm = both(llama, batch, params, max_model_len=128)
    assert on == off
    reasons = {r for _, _, r in on}
    assert reasons == {"stop", "length"}
    assert len(on[2][0]) == 4 and len(on[-1][0]) == 128 - 120  # EOS at 4; max_model_len
    assert llm.engine.overlap.num_overlapped > 10


def test_seeded_sampling_identical(llama):
    batch = prompts(8, seed=1)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=12,
                             ignore_eos=True) for i in range(8)]  # fmt: skip
    off, on, _ = both(llama, batch, params)
    assert on == off


def test_preemption_under_a_tiny_cache_gives_the_same_tokens(llama):
    batch = prompts(8, seed=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    off, on, llm = both(llama, batch, params, kv_cache_memory=14 * BLOCK_BYTES_TINY,
                        max_model_len=192)  # fmt: skip
    assert on == off
    assert llm.engine.scheduler.num_preemptions > 0


def test_grammars_stay_valid_and_identical(llama):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    specs = [SO(regex="[ab]{2,6}"), SO(json=schema), SO(choice=["yes", "no"]), None]
    batch = prompts(8, seed=3)
    params = [SamplingParams(max_tokens=24, structured_outputs=specs[i % 4], **GREEDY)
              for i in range(8)]  # fmt: skip
    off, on, _ = both(llama, batch, params)
    assert on == off
    for i, (_, text, reason) in enumerate(on):
        if i % 4 == 0:
            assert re.fullmatch("[ab]{2,6}", text)
        elif i % 4 == 1 and reason == "stop":
            assert isinstance(json.loads(text)["a"], bool)
        elif i % 4 == 2:
            assert text in ("yes", "no")


def test_lora_adapters_identical(llama, tmp_path):
    paths = write_random_adapters(llama, 3, out=tmp_path)
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    batch = prompts(8, seed=4)
    per = [loras[i % 4] if i % 4 < 3 else None for i in range(8)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    # one slot: adapters load and evict between steps, while steps overlap
    off, on, _ = both(llama, batch, params, enable_lora=True, max_loras=1, max_cpu_loras=1,
                      gen={"lora_request": per})  # fmt: skip
    assert on == off


def test_tensor_parallel_identical(llama):
    batch = prompts(6, seed=5)
    params = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    off, on, llm = both(llama, batch, params, tensor_parallel_size=2)
    assert on == off
    assert llm.engine.overlap.num_overlapped > 0


def core_request(rid: str, tokens: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **GREEDY)
    return EngineCoreRequest(rid, tokens, params)


def test_aborts_mid_stream_leak_nothing_and_say_nothing_more(llama):
    llm = LLM(model=llama, dtype="float32", block_size=16, async_scheduling=True)
    core = llm.engine
    for i, p in enumerate(prompts(6, seed=6)):
        core.add_request(core_request(f"r{i}", p["prompt_token_ids"], 30))
    seen: dict[str, int] = {}
    aborted: set[str] = set()
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.request_id not in aborted, "an aborted request spoke again"
            seen[out.request_id] = seen.get(out.request_id, 0) + len(out.new_token_ids)
        steps += 1
        if steps in (3, 6, 9):  # mid-stream, with a step in flight
            assert core.overlap.inflight is not None
            victims = [f"r{steps // 3 - 1}", f"r{steps // 3 + 2}"]
            core.abort_requests(victims)
            aborted.update(victims)
    assert all(seen.get(f"r{i}", 0) < 30 for i in range(6))  # all six were aborted midway
    assert core.overlap.inflight is None
    assert_no_leak(llm)


def test_a_reused_request_id_never_gets_its_predecessors_token(llama):
    llm = LLM(model=llama, dtype="float32", block_size=16, async_scheduling=True)
    core = llm.engine
    tokens = prompts(1, seed=7)[0]["prompt_token_ids"]
    first = llm.generate({"prompt_token_ids": tokens}, SamplingParams(max_tokens=3, **GREEDY))
    stop = first[0].outputs[0].token_ids[2]  # a stop token: the step after it is in flight

    def request():
        params = SamplingParams(max_tokens=10, stop_token_ids=[stop], **GREEDY)
        return EngineCoreRequest("same", tokens, params)

    core.add_request(request())
    got = []
    while core.has_unfinished_requests():
        for out in core.step():
            got += out.new_token_ids
            if out.finish_reason and len(got) == 3:  # reuse the id at once
                assert core.overlap.inflight is not None
                core.add_request(request())
    assert got[3:] == got[:3] and len(got) == 6  # the first run again: no stray token
    assert_no_leak(llm)


def record_calls(core) -> list[str]:
    calls: list[str] = []
    sched, update = core.scheduler.schedule, core.scheduler.update_from_output

    def schedule():
        calls.append("schedule")
        return sched()

    def update_from_output(*args):
        calls.append("update")
        return update(*args)

    core.scheduler.schedule = schedule
    core.scheduler.update_from_output = update_from_output
    return calls


@pytest.mark.parametrize("flag", [False, True])
def test_steps_overlap_only_when_on(llama, flag):
    llm = LLM(model=llama, dtype="float32", block_size=16, async_scheduling=flag)
    calls = record_calls(llm.engine)
    params = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    llm.generate(prompts(4, seed=8), params)
    overlapped = 0  # updates of step N that came after step N+1 was scheduled
    for i, call in enumerate(calls):
        if call == "update":
            done = calls[:i].count("update") + 1  # this is step ``done``'s update
            overlapped += calls[:i].count("schedule") > done
    assert calls.count("update") == calls.count("schedule")
    if flag:  # in nearly every step
        assert overlapped >= 6
    else:
        assert overlapped == 0 and calls == ["schedule", "update"] * (len(calls) // 2)


def test_the_default_is_off_on_cpu_and_the_flag_reaches_the_cli():
    from epdserve.engine.config import EngineConfig

    assert EngineConfig(model="m").async_scheduling is None  # the core: on for cuda only
    import argparse

    from epdserve.common.cli_fields import add_fields

    parser = argparse.ArgumentParser()
    add_fields(parser, EngineConfig, environ={})
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args([]).async_scheduling is None


@pytest.mark.parametrize("stage", ["schedule", "execute", "ranks", "update"])
def test_a_fault_is_contained_as_with_overlap_off(llama, monkeypatch, stage):
    """A fault for one request (in the scheduler, before the step starts, in the worker's
    step while the next is scheduled, in the update): the same tokens and errors as with
    overlap off, and nothing leaks."""
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", f"{stage}:r3")
    got = {}
    for flag in (False, True):
        llm = LLM(model=llama, dtype="float32", block_size=16, async_scheduling=flag)
        core, tokens, errors = llm.engine, {}, {}
        for i, p in enumerate(prompts(6, seed=9)):
            core.add_request(core_request(f"r{i}", p["prompt_token_ids"], 10))
        while core.has_unfinished_requests():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.error is not None:
                    errors[out.request_id] = out.error
        assert "r3" in errors and (core.guard.num_failed_steps > 0 or stage == "update")
        assert_no_leak(llm)
        got[flag] = tokens, sorted(errors)
    assert got[True] == got[False]


def test_a_kv_connector_keeps_steps_in_turn_and_loads_stay_exact(llama, tmp_path):
    """P/D over a shared volume with the flag on: overlap is off where a KV connector is (its
    loads and saves are applied in turn), and the decode pod's loaded prefix gives the
    tokens a plain engine gives."""
    prompt = {"prompt_token_ids": prompts(1, seed=10)[0]["prompt_token_ids"] * 3}
    params = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    common = dict(model=llama, dtype="float32", block_size=16, async_scheduling=True)
    pods = {}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        transfer = {"kv_connector": "SharedStorageConnector", "kv_role": kv_role,
                    "kv_connector_extra_config": {"path": str(tmp_path)}}  # fmt: skip
        pods[role] = LLM(**common, role=role, kv_transfer_config=json.dumps(transfer))
        assert pods[role].engine.overlap is None
    pods["prefill"].generate(prompt, SamplingParams(max_tokens=1, **GREEDY))
    got = pods["decode"].generate(prompt, params)[0].outputs[0].token_ids
    assert pods["decode"].engine.scheduler.kv_transfer.hits > 0
    plain = LLM(**common)
    assert plain.engine.overlap is not None
    assert got == plain.generate(prompt, params)[0].outputs[0].token_ids
    for llm in (*pods.values(), plain):
        llm.engine.close()
