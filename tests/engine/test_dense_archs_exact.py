"""Gemma2 and Phi-3: greedy outputs equal transformers' token for token (fp32) on tiny random
checkpoints shaped unlike the make-model presets (head dims 30 and 40, partial rotary, GQA and
MQA, tied and untied LM heads, explicit layer types), under prefix hits, chunked prefill and
preemption; Phi-3's fused q|k|v and gate|up are split per rank as a Llama rank's are."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from conftest_helpers import MAX_NEW, assert_no_leak

from epdserve.engine import LLM, SamplingParams
from epdserve.engine.core.kv_cache_groups import make_kv_cache_spec
from epdserve.engine.models.config import load_model_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
BLOCK = 16
COMMON = dict(vocab_size=4096, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, rms_norm_eps=1e-6)  # fmt: skip


def _factors(n: int, step: float) -> list[float]:
    return [round(1.0 + step * i, 4) for i in range(n)]


# name -> (family, config arguments, shortest prompt)
CASES = {
    # 3 layers (sliding, full, sliding: the even/odd rule), window shorter than the prompts,
    # the attention scale from query_pre_attn_scalar (not the head dim), a soft cap that bites
    "gemma2-untied-gqa-head40": ("gemma2", dict(
        hidden_size=160, intermediate_size=200, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=40, query_pre_attn_scalar=24, sliding_window=24,
        attn_logit_softcapping=0.5, final_logit_softcapping=2.0, tie_word_embeddings=False,
        max_position_embeddings=1024), 5),
    # MQA, tied, and layer types that are not the even/odd rule
    "gemma2-tied-mqa-layer-types": ("gemma2", dict(
        hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=48, query_pre_attn_scalar=48, sliding_window=20,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        attn_logit_softcapping=1.0, tie_word_embeddings=True, max_position_embeddings=1024), 5),
    # longrope over a 32-token original context: prompts longer than it, so transformers uses
    # the long factors throughout, as the engine does; 3/4 of each 30-dim head rotates
    "phi3-longrope-partial-head30": ("phi3", dict(
        hidden_size=180, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=4096,
        original_max_position_embeddings=32, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
            short_factor=_factors(11, 0.05), long_factor=_factors(11, 1.5))), 33),
    # longrope whose context is not extended (short factors, an explicit attention factor),
    # MQA, tied, a sliding window on every layer
    "phi3-short-factors-mqa-tied-window": ("phi3", dict(
        hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=512,
        original_max_position_embeddings=512, sliding_window=40, rope_parameters=dict(
            rope_type="longrope", rope_theta=500.0, attention_factor=1.25,
            short_factor=_factors(16, 0.2), long_factor=_factors(16, 3.0))), 5),
}  # fmt: skip


def write_checkpoint(models, root, name: str, seed: int = 0):
    """A random-weight checkpoint of ``CASES[name]`` beside the make-model tokenizer files."""
    from transformers import AutoModelForCausalLM, Gemma2Config, Phi3Config

    family, kwargs, _ = CASES[name]
    out = root / name
    if out.exists():
        return out
    tokenizer_dir = models.get(family)
    out.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    cls = {"gemma2": Gemma2Config, "phi3": Phi3Config}[family]
    config = cls(**COMMON, **kwargs)
    config.architectures = [{"gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM"}[family]]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out))
    return out


def prompts_from(shortest: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``shortest`` to ~120 tokens; every other one starts with a shared
    two-block prefix (32 tokens), so prefix caching hits."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 4000) for _ in range(2 * BLOCK)]
    out = []
    for i in range(n):
        length = shortest + (i * 37) % 90
        if i % 2:
            out.append(prefix + [rng.randrange(10, 4000) for _ in range(max(length - 32, 3))])
        else:
            out.append([rng.randrange(10, 4000) for _ in range(length)])
    return out


@pytest.fixture(scope="module")
def checkpoints(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("dense-archs")
    return lambda name: write_checkpoint(models, root, name)


def preemption_memory(path, max_len: int) -> int:
    """KV bytes for a little more than one longest sequence (fp32), however the layers group."""
    cfg = load_model_config(path)
    spec = make_kv_cache_spec(cfg.layer_windows())
    block_bytes = spec.slots * 2 * BLOCK * cfg.num_kv_heads * cfg.head_dim * 4
    return (spec.blocks_per_request(BLOCK, max_len, max_len) + 2) * block_bytes


def run(path, prompts, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(path), dtype="float32", **{"max_model_len": 512, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_outputs_match_transformers_cold_cached_chunked_and_preempted(
    checkpoints, hf_reference, name
):
    path = checkpoints(name)
    prompts = prompts_from(CASES[name][2])
    expected = hf_reference.greedy(path, prompts)

    llm, got = run(path, prompts)  # cold, then the same prompts from the prefix cache
    assert got == expected, f"{name}: cold"
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in again] == expected, f"{name}: prefix hits"
    assert sum(o.num_cached_tokens > 0 for o in again) >= 4
    assert_no_leak(llm)

    # 16-token chunks, and a cache too small for every prompt at once
    memory = preemption_memory(path, 192)
    llm, got = run(path, prompts, max_num_batched_tokens=BLOCK, max_model_len=192,
                   kv_cache_memory=memory)  # fmt: skip
    assert got == expected, f"{name}: chunked prefill under preemption"
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leak(llm)


@pytest.mark.parametrize(("family", "shortest"), [("gemma2", 5), ("phi3", 65)])
def test_make_model_presets_match_transformers(models, hf_reference, family, shortest):
    """The tiny presets (phi3's prompts are longer than its 64-token original context)."""
    path = models.get(family)
    prompts = prompts_from(shortest, n=4, seed=1)
    llm, got = run(path, prompts)
    assert got == hf_reference.greedy(path, prompts)
    assert_no_leak(llm)


def test_gemma2_configs_without_layer_types_slide_on_even_layers():
    from epdserve.engine.models.arch.gemma2 import parse_gemma2

    raw = dict(COMMON, hidden_size=64, intermediate_size=64, num_hidden_layers=5,
               num_attention_heads=2, head_dim=32, sliding_window=4096)  # fmt: skip
    cfg = parse_gemma2("Gemma2ForCausalLM", raw, raw)
    assert cfg.layer_windows() == [4096, None, 4096, None, 4096]


@pytest.mark.parametrize("positions", [32, 100])
def test_longrope_table_equals_transformers_short_and_long_sets(positions):
    """Up to the 32-token original context the short factors, past it the long ones, at
    every position; cos and sin scaled by the attention factor (of the 4096 / 32 extension)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from epdserve.engine.models.arch.phi3 import parse_phi3, rotary_dim
    from epdserve.engine.models.rope import cos_sin_cache

    hf_config = Phi3Config(**COMMON, **CASES["phi3-longrope-partial-head30"][1])
    cos, sin = Phi3RotaryEmbedding(hf_config)(torch.zeros(1), torch.arange(positions)[None])
    cfg = parse_phi3("Phi3ForCausalLM", hf_config.to_dict(), {})
    rot = rotary_dim(cfg.head_dim, cfg.rope)
    assert rot == 22
    ours = cos_sin_cache(cfg.rope, rot, positions, torch.float32)
    hf = torch.cat([cos[0, :, :11], sin[0, :, :11]], -1)
    torch.testing.assert_close(ours, hf, rtol=0, atol=0)


def split_phi3_checkpoint(path, out) -> None:
    """The fused tensors of a Phi-3 checkpoint as Llama's separate q/k/v and gate/up."""
    from safetensors.torch import save_file

    from epdserve.engine.models.loader import CheckpointReader

    cfg, reader = load_model_config(path), CheckpointReader(path)
    sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    tensors = {n: reader.get(n) for n in reader.names("model.") if "_proj" in n}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = tensors.pop(p + "self_attn.qkv_proj.weight").split(sizes)
        for name, t in zip(("q_proj", "k_proj", "v_proj"), qkv, strict=True):
            tensors[f"{p}self_attn.{name}.weight"] = t.contiguous()
        gate, up = tensors.pop(p + "mlp.gate_up_proj.weight").chunk(2)
        tensors[p + "mlp.gate_proj.weight"] = gate.contiguous()
        tensors[p + "mlp.up_proj.weight"] = up.contiguous()
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))


@pytest.mark.parametrize(("name", "tp"), [("phi3-longrope-partial-head30", 2),
                                          ("phi3-short-factors-mqa-tied-window", 2),
                                          ("phi3-short-factors-mqa-tied-window", 4)])  # fmt: skip
def test_phi3_ranks_hold_the_fused_rows_a_llama_rank_holds(checkpoints, tmp_path, name, tp):
    """Each rank's q|k|v and gate|up, read from the fused tensors, equal what the Llama loader
    reads for that rank from the same weights stored apart (KV heads split, or replicated
    where there are fewer than ranks)."""
    from types import SimpleNamespace

    from epdserve.engine.models.arch.base import load_attention, load_gated_mlp
    from epdserve.engine.models.layers import Shard, ShardedWeights
    from epdserve.engine.models.loader import CheckpointReader, load_model
    from epdserve.engine.worker.parallel import TPGroup

    path = checkpoints(name)
    split_phi3_checkpoint(path, tmp_path / "split")
    cfg = load_model_config(path)
    for rank in range(tp):
        model = load_model(path, torch.float32, torch.device("cpu"), 128, tp=TPGroup(rank, tp))
        llama = ShardedWeights(CheckpointReader(tmp_path / "split"), "model.", cfg,
                               Shard(rank, tp), torch.float32, torch.device("cpu"))  # fmt: skip
        for i, layer in enumerate(model.layers):
            want = SimpleNamespace()
            load_attention(want, f"layers.{i}.self_attn.", llama)
            load_gated_mlp(want, f"layers.{i}.mlp.", llama)
            assert torch.equal(layer.qkv_w, want.qkv_w), (rank, i)
            assert torch.equal(layer.gate_up_w, want.gate_up_w), (rank, i)


@pytest.mark.slow  # two worker processes, ~15 s on 2 cores
def test_phi3_tp2_greedy_matches_transformers(checkpoints, hf_reference):
    path = checkpoints("phi3-longrope-partial-head30")
    prompts = prompts_from(CASES["phi3-longrope-partial-head30"][2])
    llm, got = run(path, prompts, tensor_parallel_size=2, max_num_batched_tokens=BLOCK)
    assert got == hf_reference.greedy(path, prompts)
    assert_no_leak(llm)
    llm.engine.close()


def test_lora_on_phi3_is_refused_naming_its_fused_projections(models):
    from epdserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="enable_lora: Phi-3 adapters target its fused qkv_proj"):
        EngineConfig(model=str(models.get("phi3")), enable_lora=True)
