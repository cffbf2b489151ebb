"""Qwen3: the Llama layout with per-head q/k RMSNorms before rope, no q/k/v bias."""

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


def _config(preset: str, token_ids: dict):
    from transformers import Qwen3Config

    kw = tiny_kwargs(
        preset,
        "qwen3",
        head_dim=head_dim(preset),
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return with_architecture(Qwen3Config(**kw), "Qwen3ForCausalLM")


ARCHITECTURES = [
    Architecture(
        family="qwen3",
        hf_names=("Qwen3ForCausalLM",),
        parse=lambda name, raw, top: dense_config(name, "qwen3", raw, qk_norm=True),
        load_weights=load_llama_weights,
        hf_config=_config,
        presets=("tiny", "small", *SERVED),
    )
]
