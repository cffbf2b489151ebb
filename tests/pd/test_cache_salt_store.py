"""cache_salt and the KV connectors: stored blocks are named by salted block hashes, so a
decode engine loads a prompt's blocks from the store only under the salt they were saved
with (offline engines over a real shared volume or a real Redis)."""

from __future__ import annotations

import json

import pytest
from conftest_helpers import assert_no_leak

from epdserve.engine import LLM, SamplingParams

PROMPT = list(range(200, 250))  # 3 full 16-token blocks + 2 tokens
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def transfer(backend: str, where: str, role: str) -> str:
    connector, key = {
        "shared_storage": ("SharedStorageConnector", "path"),
        "redis": ("RedisConnector", "url"),
    }[backend]
    extra = {key: where}
    return json.dumps(
        {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    )


@pytest.fixture(params=["shared_storage", "redis"])
def store(request, tmp_path):
    if request.param == "redis":
        return "redis", request.getfixturevalue("redis_url")  # a running, empty database
    return "shared_storage", str(tmp_path)


@pytest.fixture
def engines(models, store):
    """A prefill engine that saved PROMPT under salt "a", and a fresh decode engine."""
    path = str(models.get("llama"))
    common = dict(max_model_len=256, hash_seed="7")
    producer = LLM(
        path, **common, role="prefill", kv_transfer_config=transfer(*store, "kv_producer")
    )
    producer.generate({"prompt_token_ids": PROMPT, "cache_salt": "a"}, ONE)
    assert_no_leak(producer)
    decoder = LLM(path, **common, role="decode", kv_transfer_config=transfer(*store, "kv_consumer"))
    yield decoder
    for llm in (producer, decoder):
        llm.engine.close()


def loaded_tokens(decoder: LLM, salt: str | None) -> int:
    """Tokens the decode engine loads from the store for PROMPT under ``salt``."""
    state = decoder.engine.scheduler.kv_transfer
    before = state.hits
    prompt = {"prompt_token_ids": PROMPT}
    if salt is not None:
        prompt["cache_salt"] = salt
    decoder.generate(prompt, ONE)
    assert state.load_failures == 0
    assert_no_leak(decoder)
    return state.hits - before


def test_a_prompt_under_another_salt_loads_nothing_from_the_store(engines):
    assert loaded_tokens(engines, "b") == 0
    assert loaded_tokens(engines, None) == 0


def test_a_prompt_under_the_same_salt_loads_its_blocks_from_the_store(engines):
    assert loaded_tokens(engines, "a") == 49  # 3 full blocks and the tail, but the last token
