"""Llama and Mistral: the Llama layout (RMSNorm, rope, GQA, SwiGLU); Mistral adds a sliding
window to every layer."""

from __future__ import annotations

from epdserve.engine.models.arch import Architecture
from epdserve.engine.models.arch.base import (
    SERVED,
    dense_config,
    head_dim,
    load_llama_weights,
    tiny_kwargs,
    with_architecture,
)

# llama3 rope scaling with a short original context, so the scaling really bites
TINY_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _llama_config(preset: str, token_ids: dict):
    from transformers import LlamaConfig

    kw = tiny_kwargs(
        preset,
        "llama",
        head_dim=head_dim(preset),
        tie_word_embeddings=False,
        rope_parameters=dict(TINY_ROPE),
    )
    return with_architecture(LlamaConfig(**kw), "LlamaForCausalLM")


ARCHITECTURES = [
    Architecture(
        family="llama",
        hf_names=("LlamaForCausalLM",),
        parse=lambda name, raw, top: dense_config(name, "llama", raw),
        load_weights=load_llama_weights,
        hf_config=_llama_config,
        presets=("tiny", "small", *SERVED),
    ),
    Architecture(
        family="mistral",
        hf_names=("MistralForCausalLM",),
        parse=lambda name, raw, top: dense_config(
            name, "mistral", raw, sliding_window=raw.get("sliding_window")
        ),
        load_weights=load_llama_weights,
    ),
]
