"""Gemma2: Gemma3's text decoder without q/k norms and with one rope for every layer. Scaled
embeddings, GeGLU, sandwich norms (``(1 + w)`` in fp32), ``query_pre_attn_scalar``, attention
and final-logit soft caps, and sliding-window layers alternating with global ones: the config's
``layer_types``, or where an older config has none, a window on every even layer (0, 2, ...).
"""

from __future__ import annotations

from epdserve.engine.models.arch import Architecture
from epdserve.engine.models.arch.base import (
    common_fields,
    head_dim,
    rope_params,
    tiny_kwargs,
    with_architecture,
)
from epdserve.engine.models.arch.gemma3 import Gemma3LM, load_gemma3_weights
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.decoder import DecoderLM


class Gemma2LM(Gemma3LM):
    """Gemma3's hooks (scaled embeddings, GeGLU), with one rope cache shared by every layer."""

    layer_ropes = DecoderLM.layer_ropes


def parse_gemma2(arch: str, raw: dict, top: dict) -> ModelConfig:
    layer_types = tuple(raw.get("layer_types") or ())
    if not layer_types:
        layer_types = tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(raw["num_hidden_layers"])
        )
    return ModelConfig(
        **common_fields(arch, "gemma2", raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        rope=rope_params(raw),
        sliding_window=raw.get("sliding_window") or raw.get("sliding_window_size"),
        layer_types=layer_types,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        attn_logit_softcap=raw.get("attn_logit_softcapping"),
        final_logit_softcap=raw.get("final_logit_softcapping"),
    )


def gemma2_config(preset: str, token_ids: dict):
    """Sliding windows shorter than test prompts; the soft caps at Gemma2's defaults."""
    from transformers import Gemma2Config

    dim = head_dim(preset)
    kw = tiny_kwargs(
        preset,
        "gemma2",
        head_dim=dim,
        query_pre_attn_scalar=dim,
        sliding_window=32,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
    return with_architecture(Gemma2Config(**kw), "Gemma2ForCausalLM")


ARCHITECTURES = [
    Architecture(
        family="gemma2",
        hf_names=("Gemma2ForCausalLM",),
        parse=parse_gemma2,
        load_weights=load_gemma3_weights,
        model_class=Gemma2LM,
        hf_config=gemma2_config,
    )
]
