"""LoRA across a prefill/decode pair (offline engines over a real shared volume): a decode
engine loads an adapter's blocks only for that adapter, and answers token for token as a
colocated engine with the adapter does."""

from __future__ import annotations

import json

import pytest
from conftest_helpers import assert_no_leak

from epdserve.engine import LLM, LoRARequest, SamplingParams
from epdserve.engine.lora.random_adapters import write_random_adapters

PROMPT = list(range(300, 350))  # 3 full 16-token blocks + 2 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=256, hash_seed="7", block_size=16, enable_lora=True)


def transfer(volume, role: str) -> str:
    extra = {"path": str(volume)}
    return json.dumps(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }
    )


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    path = str(models.get("llama"))
    volume = tmp_path_factory.mktemp("kv")
    paths = write_random_adapters(path, 2, out=tmp_path_factory.mktemp("loras"))
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    producer = LLM(
        path, **COMMON, role="prefill", kv_transfer_config=transfer(volume, "kv_producer")
    )
    producer.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=loras[0])
    assert_no_leak(producer)
    decoder = LLM(path, **COMMON, role="decode", kv_transfer_config=transfer(volume, "kv_consumer"))
    yield path, decoder, loras
    for llm in (producer, decoder):
        llm.engine.close()


def decode(decoder: LLM, lora) -> tuple[list[int], int]:
    """The decode engine's answer for PROMPT with ``lora``, and the tokens it loaded."""
    state = decoder.engine.scheduler.kv_transfer
    before = state.hits
    out = decoder.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=lora)[0]
    assert state.load_failures == 0
    assert_no_leak(decoder)
    return out.outputs[0].token_ids, state.hits - before


def test_the_decode_engine_loads_only_the_same_adapters_blocks_and_matches_colocated(pair):
    path, decoder, loras = pair
    assert decode(decoder, None)[1] == 0
    assert decode(decoder, loras[1])[1] == 0
    tokens, loaded = decode(decoder, loras[0])
    assert loaded == 49  # 3 full blocks and the 2-token tail, but the last token
    colocated = LLM(path, dtype="float32", block_size=16, enable_lora=True)
    want = colocated.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=loras[0])[0]
    assert tokens == want.outputs[0].token_ids
