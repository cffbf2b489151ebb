"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with sparse blocks of routed
experts whose top-k weights are not renormalised (``norm_topk_prob`` false), plus a shared
expert behind a sigmoid gate; ``decoder_sparse_step`` and ``mlp_only_layers`` leave some
layers a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from epdserve.engine.models.arch import Architecture
from epdserve.engine.models.arch.base import dense_config, tiny_kwargs, with_architecture
from epdserve.engine.models.arch.moe_common import (
    EXPERTS,
    LORA_REFUSAL,
    expert_fields,
    sparse_layers,
)
from epdserve.engine.models.moe import MoeLM
from epdserve.engine.models.moe_weights import QWEN, moe_weight_loader


def _parse(name: str, raw: dict, top: dict):
    sliding = {}
    if raw.get("use_sliding_window") and raw.get("layer_types"):
        sliding = dict(sliding_window=raw["sliding_window"], layer_types=tuple(raw["layer_types"]))
    return dense_config(
        name,
        "qwen2_moe",
        raw,
        qkv_bias=bool(raw.get("qkv_bias", True)),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
        sparse_layers=sparse_layers(raw),
        **sliding,
        **expert_fields(
            raw, raw["num_experts"], raw["moe_intermediate_size"], raw.get("norm_topk_prob", False)
        ),
    )


def _config(preset: str, token_ids: dict):
    from transformers import Qwen2MoeConfig

    num, top_k, inter = EXPERTS[preset]
    kw = tiny_kwargs(
        preset,
        "qwen2_moe",
        num_experts=num,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=2 * inter,
        norm_topk_prob=False,
        mlp_only_layers=[0],  # one dense layer, as a checkpoint may have
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return with_architecture(Qwen2MoeConfig(**kw), "Qwen2MoeForCausalLM")


ARCHITECTURES = [
    Architecture(
        family="qwen2_moe",
        hf_names=("Qwen2MoeForCausalLM",),
        parse=_parse,
        load_weights=moe_weight_loader(QWEN),
        model_class=MoeLM,
        hf_config=_config,
        lora_refusal=LORA_REFUSAL.format(family="Qwen2-MoE"),
    )
]
