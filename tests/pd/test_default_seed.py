"""Pods given no --hash-seed still share blocks when they share a store: the seed is derived
from the checkpoint. Pods that share nothing keep a random one."""

from __future__ import annotations

import json

from pd_support import engine_core, prompts

from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.sampling_params import SamplingParams

core = engine_core


def finish(engine: EngineCore, req: EngineCoreRequest) -> list:
    engine.add_request(req)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_pods_without_a_seed_share_blocks_through_their_store(models, tmp_path):
    path = models.get("llama")
    prefill, decode = core(path, "prefill", tmp_path), core(path, "decode", tmp_path)
    assert prefill.hasher.root == decode.hasher.root
    prompt = prompts(seed=61, lengths=(70,))[0]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    params = next(
        o.kv_transfer_params for o in finish(prefill, EngineCoreRequest("p", prompt, one)) if o
    )
    finish(decode, EngineCoreRequest("d", prompt, one, kv_transfer_params=params))
    assert decode.stats().external_hits == 69  # four whole blocks and the tail, but one token


def test_a_pod_publishing_kv_events_derives_the_same_seed(models, tmp_path):
    path = models.get("llama")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///tmp/x"}
    publishing = core(path, kv_events_config=json.dumps(events))
    assert publishing.hasher.root == core(path, "prefill", tmp_path).hasher.root


def test_pods_that_share_nothing_keep_random_roots_and_a_given_seed_wins(models):
    path = models.get("llama")
    assert core(path).hasher.root != core(path).hasher.root
    assert core(path, hash_seed="s").hasher.root == core(path, hash_seed="s").hasher.root
