"""Mixture-of-experts models under tensor parallelism (experts split by intermediate size, one
all-reduce per sparse block) and the refusals: a TP size that does not divide an expert's
intermediate size, and LoRA."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest_helpers import MAX_NEW, assert_no_leak, make_prompts

from epdserve.engine import LLM, SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.lora.core_side import make_manager
from epdserve.engine.models.config import load_model_config
from epdserve.engine.models.layers import check_tensor_parallel

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# qwen2_moe tiny at TP 2: layers * K/V * block * (2 kv heads / 2) * head dim * fp32
RANK_BLOCK_BYTES = 4 * 2 * 16 * 1 * 32 * 4


def test_tp2_qwen2_moe_equals_transformers_chunked_preempted_and_cached(models, hf_reference):
    """The preset has a dense layer, sparse layers and a shared expert: every split kind."""
    path = models.get("qwen2_moe")
    prompts = make_prompts(6)
    expected = hf_reference.greedy(path, prompts)
    llm = LLM(
        model=str(path), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16,
        kv_cache_memory=14 * RANK_BLOCK_BYTES, max_model_len=192,
    )  # fmt: skip
    assert llm.engine.executor.size == 2
    inputs = [{"prompt_token_ids": p} for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in llm.generate(inputs, GREEDY)] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(inputs, GREEDY)  # now from the prefix cache
    assert [list(o.outputs[0].token_ids) for o in again] == expected
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_no_leak(llm)
    llm.engine.close()


def test_a_tp_that_does_not_divide_an_expert_intermediate_size_is_refused(models):
    cfg = load_model_config(models.get("qwen2_moe"))
    check_tensor_parallel(cfg, 4)  # 4 heads, 2 KV heads, experts of 64, shared of 128
    with pytest.raises(ValueError, match="4 does not divide the model's expert intermediate"):
        check_tensor_parallel(replace(cfg, moe_intermediate_size=50), 4)
    with pytest.raises(ValueError, match="2 does not divide the model's shared expert"):
        check_tensor_parallel(replace(cfg, shared_expert_intermediate_size=63), 2)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_lora_on_an_moe_model_is_refused_naming_enable_lora(models, arch):
    path = str(models.get(arch))
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters do not apply to mixture"):
        EngineConfig(model=path, enable_lora=True)
    EngineConfig(model=path)  # without LoRA it is served


def test_the_core_refuses_lora_for_a_model_dir_resolved_after_the_config_check(models):
    """The core's LoRA manager (built once the model is local) refuses it too."""
    path = models.get("mixtral")
    config = EngineConfig(model="org/remote-moe", enable_lora=True)  # no local config.json
    with pytest.raises(ValueError, match="enable_lora: .*Mixtral"):
        make_manager(config, load_model_config(path))
    assert make_manager(config, load_model_config(models.get("llama"))) is not None
