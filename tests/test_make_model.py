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
