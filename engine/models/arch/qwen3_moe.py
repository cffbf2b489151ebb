"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorms, no bias) with every layer's MLP a
sparse block of routed experts, top-k weights renormalised (``norm_topk_prob``, true in the
released checkpoints), no shared expert."""

from __future__ import annotations

from epdserve.engine.models.arch import Architecture
from epdserve.engine.models.arch.base import (
    SERVED_MOE,
    dense_config,
    head_dim,
    tiny_kwargs,
    with_architecture,
)
from epdserve.engine.models.arch.moe_common import (
    LORA_REFUSAL,
    expert_fields,
    experts,
    sparse_layers,
)
from epdserve.engine.models.moe import MoeLM
from epdserve.engine.models.moe_weights import QWEN, moe_weight_loader


def _parse(name: str, raw: dict, top: dict):
    experts = raw.get("num_experts") or raw["num_local_experts"]
    return dense_config(
        name,
        "qwen3_moe",
        raw,
        qk_norm=True,
        sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window") else None,
        sparse_layers=sparse_layers(raw),
        **expert_fields(
            raw, experts, raw["moe_intermediate_size"], raw.get("norm_topk_prob", False)
        ),
    )


def _config(preset: str, token_ids: dict):
    from transformers import Qwen3MoeConfig

    num, top_k, inter = experts(preset, "qwen3_moe")
    kw = tiny_kwargs(
        preset,
        "qwen3_moe",
        head_dim=head_dim(preset),
        num_experts=num,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return with_architecture(Qwen3MoeConfig(**kw), "Qwen3MoeForCausalLM")


ARCHITECTURES = [
    Architecture(
        family="qwen3_moe",
        hf_names=("Qwen3MoeForCausalLM",),
        parse=_parse,
        load_weights=moe_weight_loader(QWEN),
        model_class=MoeLM,
        hf_config=_config,
        presets=("tiny", "small", *SERVED_MOE),
        lora_refusal=LORA_REFUSAL.format(family="Qwen3-MoE"),
    )
]
