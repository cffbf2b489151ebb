"""The cpu default of max_num_batched_tokens: 2,048, down to 512 where a step's matrix
products would take long (large models on few cores); a given value always wins."""

from __future__ import annotations

from types import SimpleNamespace

from epdserve.engine.cpus import (
    DEFAULT_BATCHED_TOKENS,
    batched_tokens,
    layer_params,
    resolve_batched_tokens,
)
from epdserve.engine.make_model import SIZES
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.serving_shapes import SHAPES, VOCAB


def shape_config(hidden, layers, heads, kv_heads, head_dim, inter, vocab=VOCAB):
    return ModelConfig(
        architecture="LlamaForCausalLM", family="llama", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-6, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )  # fmt: skip


def test_the_lm_head_is_not_a_per_token_weight():
    cfg = shape_config(*SHAPES["qwen2.5-0.5b"])
    assert layer_params(cfg) == 24 * (896 * (896 + 2 * 128) + 896 * 896 + 3 * 896 * 4864)


def test_large_models_on_few_cores_get_small_steps_and_small_models_keep_2048():
    half_b = layer_params(shape_config(*SHAPES["qwen2.5-0.5b"]))
    one_b = layer_params(shape_config(*SHAPES["llama3.2-1b"]))
    small = layer_params(shape_config(*SIZES["small"]))  # 50M
    tiny = layer_params(shape_config(*SIZES["tiny"]))
    assert batched_tokens(2, half_b) == 512  # measured: TTFT p50 4.5 s vs 5.9 s at 2,048
    assert batched_tokens(1, half_b) == batched_tokens(2, one_b) == 512  # the floor
    assert batched_tokens(2, small) == DEFAULT_BATCHED_TOKENS
    assert batched_tokens(2, tiny) == DEFAULT_BATCHED_TOKENS
    assert batched_tokens(8, half_b) == 2048 and batched_tokens(4, half_b) == 1024
    assert batched_tokens(2, 0) == DEFAULT_BATCHED_TOKENS


def test_a_given_budget_wins_and_gpus_keep_2048():
    cfg = shape_config(*SHAPES["llama3.2-1b"])
    given = SimpleNamespace(max_num_batched_tokens=4096, device="cpu")
    assert resolve_batched_tokens(given, cfg) == 4096
    gpu = SimpleNamespace(max_num_batched_tokens=None, device="cuda:0")
    assert resolve_batched_tokens(gpu, cfg) == DEFAULT_BATCHED_TOKENS


def test_the_engine_core_schedules_with_the_resolved_budget(models):
    from epdserve.engine import LLM

    llm = LLM(model=str(models.get("llama")), dtype="bfloat16", max_model_len=256)
    assert llm.engine.scheduler.max_num_batched_tokens == DEFAULT_BATCHED_TOKENS
    assert llm.engine.config.max_num_batched_tokens == DEFAULT_BATCHED_TOKENS
    llm = LLM(model=str(models.get("llama")), max_model_len=256, max_num_batched_tokens=64)
    assert llm.engine.scheduler.max_num_batched_tokens == 64
