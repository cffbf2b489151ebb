"""Mixtral: the Llama layout with every MLP a sparse block of ``num_local_experts`` SwiGLU
experts, the top 2 (``num_experts_per_tok``) per token by a softmax router, their weights
renormalised; experts as on the hub (``block_sparse_moe.experts.{e}.w1/w3/w2``)."""

from __future__ import annotations

from epdserve.engine.models.arch import Architecture
from epdserve.engine.models.arch.base import (
    SERVED_MOE,
    dense_config,
    head_dim,
    tiny_kwargs,
    with_architecture,
)
from epdserve.engine.models.arch.moe_common import LORA_REFUSAL, expert_fields, experts
from epdserve.engine.models.moe import MoeLM
from epdserve.engine.models.moe_weights import MIXTRAL, moe_weight_loader


def _parse(name: str, raw: dict, top: dict):
    experts = expert_fields(raw, raw["num_local_experts"], raw["intermediate_size"], True)
    return dense_config(name, "mixtral", raw, sliding_window=raw.get("sliding_window"), **experts)


def _config(preset: str, token_ids: dict):
    from transformers import MixtralConfig

    num, top_k, inter = experts(preset, "mixtral")
    kw = tiny_kwargs(
        preset,
        "mixtral",
        head_dim=head_dim(preset),
        intermediate_size=inter,
        num_local_experts=num,
        num_experts_per_tok=top_k,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return with_architecture(MixtralConfig(**kw), "MixtralForCausalLM")


ARCHITECTURES = [
    Architecture(
        family="mixtral",
        hf_names=("MixtralForCausalLM",),
        parse=_parse,
        load_weights=moe_weight_loader(MIXTRAL),
        model_class=MoeLM,
        hf_config=_config,
        presets=("tiny", "small", *SERVED_MOE),
        lora_refusal=LORA_REFUSAL.format(family="Mixtral"),
    )
]
