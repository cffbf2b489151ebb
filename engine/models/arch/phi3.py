"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share its class): the Llama layout with fused
``qkv_proj`` and ``gate_up_proj`` checkpoint tensors, ``longrope`` rope scaling
(``rope.py`` says which factors apply at which positions), and rotary over the first
``partial_rotary_factor`` of each head.

Under tensor parallelism each rank reads only its rows of the fused tensors: its query heads'
rows of the q part, its KV heads' rows of the k and of the v parts, and its share of the gate
part and of the up part, so its fused weights are laid out as a Llama rank's are.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from epdserve.engine.models.arch import Architecture
from epdserve.engine.models.arch.base import (
    dense_config,
    load_embeddings,
    rope_params,
    tiny_kwargs,
    with_architecture,
)
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.decoder import DecoderLM
from epdserve.engine.models.layers import Shard, ShardedWeights
from epdserve.engine.models.rope import cos_sin_cache

# make-model: a short original context, so generations cross into the long factors
TINY_ORIGINAL_CONTEXT = 64


class Phi3LM(DecoderLM):
    """``DecoderLM`` whose rope tables cover the first ``partial_rotary_factor`` of a head."""

    def rope_cache(self, params: dict, max_positions: int) -> torch.Tensor:
        rot_dim = rotary_dim(self.config.head_dim, params)
        cache = cos_sin_cache(params, rot_dim, max_positions, torch.float32)
        return cache.to(device=self.device, dtype=self.dtype)


def rotary_dim(head_dim: int, rope: dict) -> int:
    return int(head_dim * rope.get("partial_rotary_factor", 1.0))


def parse_phi3(arch: str, raw: dict, top: dict) -> ModelConfig:
    rope = rope_params(raw)
    if rope.get("rope_type") in ("su", "yarn"):  # older names of longrope in Phi-3 configs
        rope["rope_type"] = "longrope"
    rope.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if rope.get("rope_type") == "longrope":
        rope.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw["max_position_embeddings"]),
        )
        rope.setdefault("max_position_embeddings", raw["max_position_embeddings"])
    config = dense_config(arch, "phi3", raw, sliding_window=raw.get("sliding_window"))
    return replace(config, rope=rope)


def qkv_rows(cfg: ModelConfig, shard: Shard) -> list[tuple[int, int]]:
    """``[start, end)`` row spans of ``qkv_proj`` that ``shard`` keeps: its q, k and v heads."""
    d, q, kv = cfg.head_dim, cfg.q_size, cfg.kv_size
    first, end = (h * d for h in shard.split(cfg.num_heads))
    kv_first, count = shard.kv_heads(cfg.num_kv_heads)
    k0, k1 = kv_first * d, (kv_first + count) * d
    return [(first, end), (q + k0, q + k1), (q + kv + k0, q + kv + k1)]


def gate_up_rows(cfg: ModelConfig, shard: Shard) -> list[tuple[int, int]]:
    """Row spans of ``gate_up_proj`` that ``shard`` keeps: its share of gate, then of up."""
    n = cfg.intermediate_size
    start, end = shard.split(n)
    return [(start, end), (n + start, n + end)]


def load_phi3_weights(model: Phi3LM, w: ShardedWeights) -> None:
    cfg = w.cfg
    load_embeddings(model, w)
    for i, layer in enumerate(model.layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        layer.qkv_w = w.fused_rows(a + "qkv_proj.weight", qkv_rows(cfg, w.shard))
        layer.o_w = w.row(a + "o_proj.weight", cfg.q_size)
        layer.gate_up_w = w.fused_rows(p + "mlp.gate_up_proj.weight", gate_up_rows(cfg, w.shard))
        layer.down_w = w.row(p + "mlp.down_proj.weight", cfg.intermediate_size)
        layer.in_norm = w.full(p + "input_layernorm.weight")
        layer.mlp_norm = w.full(p + "post_attention_layernorm.weight")


def longrope(rot_dim: int, original: int) -> dict:
    """Deterministic short and long factors for a checkpoint of ``rot_dim`` rotary dims."""
    half = rot_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [round(1.0 + 0.05 * i, 4) for i in range(half)],
        "long_factor": [round(1.0 + 1.5 * i, 4) for i in range(half)],
        "original_max_position_embeddings": original,
    }


def phi3_config(preset: str, token_ids: dict):
    """An untied checkpoint with longrope over a 64-token original context (4096 now)."""
    from transformers import Phi3Config

    kw = tiny_kwargs(
        preset,
        "phi3",
        tie_word_embeddings=False,
        original_max_position_embeddings=TINY_ORIGINAL_CONTEXT,
    )
    head_dim = kw["hidden_size"] // kw["num_attention_heads"]
    kw["rope_parameters"] = longrope(head_dim, TINY_ORIGINAL_CONTEXT)
    return with_architecture(Phi3Config(**kw), "Phi3ForCausalLM")


ARCHITECTURES = [
    Architecture(
        family="phi3",
        hf_names=("Phi3ForCausalLM",),
        parse=parse_phi3,
        load_weights=load_phi3_weights,
        model_class=Phi3LM,
        hf_config=phi3_config,
        lora_refusal="Phi-3 adapters target its fused qkv_proj and gate_up_proj, not yet split",
    )
]
