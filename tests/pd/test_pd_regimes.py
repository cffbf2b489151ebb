"""In-process P/D: a decode engine that loads prompts stays token-exact vs transformers under
chunked prefill and preemption (offline ``LLM`` engines over one shared-storage volume)."""

from __future__ import annotations

import json

import pytest
from conftest_helpers import MAX_NEW, assert_no_leak, make_prompts

from epdserve.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
BLOCK_BYTES_TINY = 4 * 2 * 16 * 2 * 32 * 4
REGIMES = {
    "whole": {},
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(kv_cache_memory=14 * BLOCK_BYTES_TINY, max_model_len=192),
}


def transfer(volume, role: str) -> str:
    extra = {"path": str(volume)}
    return json.dumps(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }
    )


@pytest.mark.parametrize("regime", REGIMES)
def test_a_decode_engine_loading_prompts_matches_transformers(
    models, hf_reference, tmp_path, regime
):
    path = str(models.get("llama"))
    prompts = make_prompts(8, seed=3)
    expected = hf_reference.greedy(path, prompts)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    common = dict(max_model_len=512, hash_seed="7")
    producer = LLM(
        path,
        **common,
        max_num_batched_tokens=16,
        role="prefill",
        kv_transfer_config=transfer(tmp_path, "kv_producer"),
    )
    producer.generate(inputs, SamplingParams(temperature=0.0, max_tokens=1))
    assert_no_leak(producer)
    decoder = LLM(
        path,
        **{**common, **REGIMES[regime]},
        role="decode",
        kv_transfer_config=transfer(tmp_path, "kv_consumer"),
    )
    got = [o.outputs[0].token_ids for o in decoder.generate(inputs, GREEDY)]
    assert got == expected
    transfer_state = decoder.engine.scheduler.kv_transfer
    assert transfer_state.hits > 0 and transfer_state.load_failures == 0
    assert_no_leak(decoder)
    if regime == "preemption":
        assert decoder.engine.scheduler.num_preemptions > 0
    for engine in (producer, decoder):
        engine.engine.close()
