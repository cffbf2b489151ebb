"""``epdserve make-model`` checkpoints load in transformers offline and generate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

TEXT_ARCHS = ("llama", "qwen2", "qwen3")


@pytest.mark.parametrize("arch", TEXT_ARCHS)
def test_text_checkpoint_loads_and_generates_in_transformers(models, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.get(arch)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8) or tok.eos_token_id in out[0, ids.shape[1] :]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == 4096


def test_gemma3_checkpoint_loads_with_its_processor_and_generates(models):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = models.get("gemma3")
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=text, images=[Image.new("RGB", (80, 50), (200, 10, 10))], return_tensors="pt"
    )
    image_id = model.config.image_token_index
    assert int((inputs.input_ids == image_id).sum()) == model.config.mm_tokens_per_image
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs.input_ids.shape[1]
    types = model.config.text_config.layer_types
    assert "sliding_attention" in types and "full_attention" in types


def test_same_seed_gives_byte_identical_files(models, tmp_path):
    from epdserve.engine.make_model import checkpoint_digest, make_model

    first = checkpoint_digest(models.get("llama", seed=0))
    second = checkpoint_digest(make_model("llama", tmp_path / "again", seed=0))
    assert first == second
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(
        first
    )


def test_another_seed_gives_other_weights(models):
    from epdserve.engine.make_model import checkpoint_digest

    a = checkpoint_digest(models.get("llama", seed=0))
    b = checkpoint_digest(models.get("llama", seed=1))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_cli_writes_a_checkpoint(tmp_path):
    code = "import sys; from epdserve.engine.cli import main; sys.exit(main(sys.argv[1:]))"
    out = tmp_path / "q3"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "make-model",
            "--arch",
            "qwen3",
            "--out",
            str(out),
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["architectures"] == [
        "Qwen3ForCausalLM"
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 4096 and config["model_type"] == "qwen3"
    assert torch.__version__  # the engine extra is installed in the test environment


@pytest.mark.parametrize(
    ("preset", "shape", "params"),
    [
        ("qwen2.5-0.5b", (896, 24, 14, 2, 64, 4864), 387_230_592),
        ("llama3.2-1b", (2048, 16, 32, 8, 64, 8192), 1_040_254_976),
    ],
)
def test_real_shaped_presets_have_the_real_models_shapes_tied_at_our_vocab(preset, shape, params):
    from epdserve.engine.make_model import build_config
    from epdserve.engine.serving_shapes import parameter_count

    cfg = build_config("llama", preset, {})
    got = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads)
    got += (cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    assert got == shape
    assert (cfg.vocab_size, cfg.tie_word_embeddings) == (32768, True)
    assert parameter_count(cfg) == params


def test_real_shaped_presets_are_for_text_models_only(tmp_path):
    from epdserve.engine.make_model import make_model

    with pytest.raises(ValueError, match="preset: qwen2.5-0.5b is for llama, qwen2, qwen3,"):
        make_model("gemma3", tmp_path, preset="qwen2.5-0.5b")
    assert not any(tmp_path.iterdir())
    cli = [sys.executable, "-m", "epdserve.engine.cli", "make-model", "--arch", "gemma3"]
    res = subprocess.run(
        [*cli, "--preset", "llama3.2-1b", "--out", str(tmp_path / "g")],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "make-model: preset: llama3.2-1b is for llama, qwen2, qwen3" in res.stderr


def _shrunk_qwen2_config():
    """The 0.5B preset's Qwen2 config cut to one layer and a small vocab: the same kinds of
    tensors (biases, norms, a tied head) in a few MB."""
    from epdserve.engine.make_model import build_config

    cfg = build_config("qwen2", "qwen2.5-0.5b", {})
    cfg.num_hidden_layers, cfg.vocab_size = 1, 512
    cfg.layer_types = cfg.layer_types[:1]
    return cfg


def test_streamed_bf16_weights_are_every_tensor_transformers_expects(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from epdserve.engine.serving_shapes import parameter_shapes, write_random_weights

    cfg = _shrunk_qwen2_config()
    size = write_random_weights(cfg, tmp_path / "model.safetensors", seed=0)
    assert size == (tmp_path / "model.safetensors").stat().st_size
    tensors = load_file(tmp_path / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == dict(parameter_shapes(cfg))
    assert "lm_head.weight" not in tensors  # tied: stored once, as the embedding
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    assert bool((tensors["model.norm.weight"] == 1).all())
    assert bool((tensors["model.layers.0.self_attn.q_proj.bias"] == 0).all())
    std = float(tensors["model.embed_tokens.weight"].float().std())
    assert abs(std - cfg.initializer_range) < 0.002
    cfg.save_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_streamed_weights_are_the_same_bytes_for_the_same_seed(tmp_path):
    from epdserve.engine.serving_shapes import write_random_weights

    cfg = _shrunk_qwen2_config()
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        write_random_weights(cfg, tmp_path / name, seed)
    a, b, c = ((tmp_path / n).read_bytes() for n in "abc")
    assert a == b and a != c


@pytest.mark.slow
def test_the_half_billion_preset_loads_in_our_engine_and_generates(tmp_path):
    from epdserve.engine import LLM, SamplingParams
    from epdserve.engine.make_model import make_model

    path = make_model("llama", tmp_path / "m", seed=0, preset="qwen2.5-0.5b")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=256, seed=0)
    assert llm.tokenizer.tokenizer.get_vocab_size() == 32768  # every id the model samples
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(10, 42))}], sp)
    assert len(out[0].outputs[0].token_ids) == 8 and out[0].outputs[0].text


def test_lora_adapters_are_refused_for_a_mixture_of_experts_checkpoint(tmp_path):
    from epdserve.engine.make_model import make_model

    with pytest.raises(ValueError, match="lora: LoRA adapters do not apply to mixture-of-experts"):
        make_model("mixtral", tmp_path, lora=1)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("arch", "experts", "total", "per_token"),
    [("mixtral", (8, 2, 2816), 641_811_456, 193_003_520),
     ("qwen3_moe", (64, 8, 256), 491_276_288, 105_381_888)],
)  # fmt: skip
def test_the_served_moe_shape_has_its_experts(arch, experts, total, per_token):
    """moe-0.6b: one attention shape, each family's kind of experts; every weight counted,
    and what a token runs (cpus.matmul_params: its top-k experts, not all)."""
    from epdserve.engine.cpus import matmul_params
    from epdserve.engine.make_model import build_config
    from epdserve.engine.models import arch as registry
    from epdserve.engine.serving_shapes import parameter_count

    cfg = build_config(arch, "moe-0.6b", {})
    parsed = registry.by_family(arch).parse(cfg.architectures[0], cfg.to_dict(), cfg.to_dict())
    assert (parsed.num_experts, parsed.num_experts_per_tok, parsed.moe_intermediate_size) == experts
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (1024, 8, 32768)
    assert parameter_count(cfg) == total
    assert matmul_params(parsed) == per_token
