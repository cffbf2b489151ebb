"""``make-model`` presets shaped like the models users serve on CPU, with random weights.

The ``tiny`` preset is a model where framework overhead is most of the step; these are
where the matrix products are. Random weights and our own tokenizer (no weights can be
downloaded here), but the real models' shapes:

- ``qwen2.5-0.5b``: Qwen2.5-0.5B's hidden 896, 24 layers, 14 heads and 2 KV heads of 64,
  intermediate 4,864, tied embeddings; 0.39B parameters at our vocab.
- ``llama3.2-1b``: Llama-3.2-1B's hidden 2,048, 16 layers, 32 heads and 8 KV heads of 64,
  intermediate 8,192, tied embeddings, its llama3 rope scaling; 1.04B parameters at our vocab
  (the real one has 1.24B: its vocab is 128,256).

Both use a vocab of 32,768: the tokenizer is trained at that size too (2-3 s), so every id the
model can sample has text, as with a real model. (Were the model's vocab larger than the
tokenizer's, an id the tokenizer lacks decodes to no text in our detokenizer, no error.)

``moe-0.6b`` is a mixture-of-experts shape for ``mixtral`` and ``qwen3_moe`` (hidden 1,024, 8
layers, 16 heads and 4 KV heads of 64): Mixtral-like, 8 experts of 2,816, top 2 (0.65B
parameters, 0.19B run per token); Qwen3-MoE-like, 64 experts of 256, top 8 (0.50B, 0.15B per
token). Its experts are written by transformers (``save_pretrained``: the hub's per-expert
tensors), in bf16.

The weights are written in bf16, as users' checkpoints are, one tensor at a time straight
into ``model.safetensors``: the 1B model is never in memory whole (an fp32 copy is 4 GB).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

VOCAB = 32768
# (hidden, layers, heads, kv_heads, head_dim, intermediate), as make_model.SIZES
SHAPES = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 64, 4864),
    "llama3.2-1b": (2048, 16, 32, 8, 64, 8192),
}
# mixture-of-experts shapes, as SHAPES; the experts are the architecture's (arch/moe_common)
MOE_SHAPES = {"moe-0.6b": (1024, 8, 16, 4, 64, 2816)}
# what the real configs set besides the shape (initializer_range: the std of our weights)
CONFIG = {
    "qwen2.5-0.5b": dict(
        tie_word_embeddings=True, max_position_embeddings=32768, initializer_range=0.02
    ),
    "llama3.2-1b": dict(
        tie_word_embeddings=True, max_position_embeddings=131072, initializer_range=0.02
    ),
    "moe-0.6b": dict(
        tie_word_embeddings=False, max_position_embeddings=32768, initializer_range=0.02
    ),
}
LLAMA32_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def config_overrides(arch: str, preset: str) -> dict:
    """Config fields of ``preset`` that differ from the tiny presets' for ``arch``."""
    kw = dict(CONFIG[preset], vocab_size=VOCAB)
    if arch == "llama":  # the real llama3 scaling, not the tiny preset's short context
        kw["rope_parameters"] = dict(LLAMA32_ROPE)
    if arch in ("llama", "qwen3"):
        kw["head_dim"] = {**SHAPES, **MOE_SHAPES}[preset][4]
    return kw


def _meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def parameter_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """Name and shape of every tensor the checkpoint stores (a tied head is stored once),
    from a model on the meta device: no memory for weights."""
    return [(name, tuple(p.shape)) for name, p in _meta_model(config).named_parameters()]


def parameter_count(config) -> int:
    """Parameters of ``config``'s model, tied embeddings counted once."""
    return sum(_numel(shape) for _, shape in parameter_shapes(config))


def _random_tensor(name: str, shape: tuple[int, ...], std: float, generator):
    """As transformers initializes: norms one, biases zero, the rest normal(0, std)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    fp32 = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    return fp32.to(torch.bfloat16)


def write_random_weights(config, path: str | Path, seed: int) -> int:
    """Write ``config``'s model with random bf16 weights to the safetensors file ``path``,
    one tensor in memory at a time; same seed, same bytes. Returns the bytes written."""
    import torch

    shapes = parameter_shapes(config)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        size = 2 * _numel(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    generator = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in shapes:
            tensor = _random_tensor(name, shape, config.initializer_range, generator)
            f.write(tensor.view(torch.uint8).numpy().data)
    return 8 + len(blob) + offset


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
