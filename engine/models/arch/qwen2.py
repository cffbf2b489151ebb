"""Qwen2: the Llama layout with q/k/v biases and tied embeddings; a sliding window only when
``use_sliding_window`` says so."""

from __future__ import annotations

from epdserve.engine.models.arch import Architecture
from epdserve.engine.models.arch.base import (
    SERVED,
    dense_config,
    load_llama_weights,
    tiny_kwargs,
    with_architecture,
)


def _parse(name: str, raw: dict, top: dict):
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    return dense_config(name, "qwen2", raw, qkv_bias=True, sliding_window=sliding)


def _config(preset: str, token_ids: dict):
    from transformers import Qwen2Config

    kw = tiny_kwargs(
        preset,
        "qwen2",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return with_architecture(Qwen2Config(**kw), "Qwen2ForCausalLM")


ARCHITECTURES = [
    Architecture(
        family="qwen2",
        hf_names=("Qwen2ForCausalLM",),
        parse=_parse,
        load_weights=load_llama_weights,
        hf_config=_config,
        presets=("tiny", "small", *SERVED),
    )
]
