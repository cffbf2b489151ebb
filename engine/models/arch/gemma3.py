"""Gemma3's text decoder, a ``DecoderLM``: scaled embeddings, GeGLU, sandwich norms around
attention and MLP (all norms ``(1 + w)`` in fp32), q/k norms, and interleaved sliding-window /
global layers with their own rope bases (the config's ``layer_types``). Image embeddings can
replace token embeddings (``inputs_embeds``), and image spans attend bidirectionally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.engine.models.arch import Architecture
from epdserve.engine.models.arch.base import SIZES, common_fields, load_embeddings, tiny_kwargs
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.decoder import DecoderLM
from epdserve.engine.models.layers import ShardedWeights
from epdserve.kernels.backends import KernelBackend


class Gemma3LM(DecoderLM):
    """``DecoderLM`` with Gemma3's hooks; its config carries the rest (per-layer windows,
    q/k norms, ``query_pre_attn_scalar``, attention and final logit soft caps)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        kernels: KernelBackend | None = None,
    ):
        super().__init__(config, dtype, device, max_positions, kernels)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype)

    def layer_ropes(self, max_positions: int) -> list[torch.Tensor]:
        """A rope cache per attention kind (sliding layers: the local base)."""
        by_kind = {
            kind: self.rope_cache(params, max_positions)
            for kind, params in self.config.rope_by_layer_type.items()
        }
        return [by_kind[kind] for kind in self.config.layer_types]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embed_scale

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


def load_gemma3_weights(model: Gemma3LM, w: ShardedWeights) -> None:
    """This rank's slice of every weight; norms are fp32 ``1 + w``. Gemma2 loads with it too:
    its config has no q/k norms and may untie the LM head."""
    load_embeddings(model, w)  # the embedding, and the LM head (the embedding where tied)
    model.final_norm = w.norm("norm.weight")
    for i, layer in enumerate(model.layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        layer.qkv_w = w.qkv(a)
        layer.o_w = w.row(a + "o_proj.weight", w.cfg.q_size)
        if w.cfg.qk_norm:
            layer.q_norm, layer.k_norm = w.norm(a + "q_norm.weight"), w.norm(a + "k_norm.weight")
        layer.gate_up_w = torch.cat(
            [w.column(p + "mlp.gate_proj.weight"), w.column(p + "mlp.up_proj.weight")]
        )
        layer.down_w = w.row(p + "mlp.down_proj.weight", w.cfg.intermediate_size)
        layer.in_norm = w.norm(p + "input_layernorm.weight")
        layer.post_attn_norm = w.norm(p + "post_attention_layernorm.weight")
        layer.mlp_norm = w.norm(p + "pre_feedforward_layernorm.weight")
        layer.post_mlp_norm = w.norm(p + "post_feedforward_layernorm.weight")


def parse_gemma3(arch: str, raw: dict, top: dict) -> ModelConfig:
    layer_types = tuple(raw.get("layer_types") or ())
    if not layer_types:
        pattern = raw.get("sliding_window_pattern", 6)
        layer_types = tuple(
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(raw["num_hidden_layers"])
        )
    rope = raw.get("rope_parameters") or {}
    if "full_attention" not in rope:  # older layout: rope_theta + rope_local_base_freq
        rope = {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": raw.get("rope_theta", 1e6),
                **(raw.get("rope_scaling") or {}),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": raw.get("rope_local_base_freq", 1e4),
            },
        }
    return ModelConfig(
        **common_fields(arch, "gemma3", raw, raw.get("eos_token_id", top.get("eos_token_id"))),
        tie_word_embeddings=True,
        qk_norm=True,
        sliding_window=raw.get("sliding_window"),
        layer_types=layer_types,
        rope_by_layer_type=rope,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        attn_logit_softcap=raw.get("attn_logit_softcapping"),
        final_logit_softcap=raw.get("final_logit_softcapping"),
        multimodal=top if "vision_config" in top else {},
    )


def gemma3_config(preset: str, token_ids: dict):
    """An image+text checkpoint: sliding windows much shorter than test prompts, one global
    layer in four, a small SigLIP encoder."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    hidden, layers, _, _, head_dim, _ = SIZES[preset]
    n_layers = max(layers, 4)
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)
    ]
    text = Gemma3TextConfig(
        **tiny_kwargs(
            preset,
            "gemma3",
            hidden_size=hidden * 2,
            num_hidden_layers=n_layers,
            head_dim=head_dim * 2,
            query_pre_attn_scalar=head_dim * 2,
            sliding_window=32,
            layer_types=layer_types,
        )
    )
    vision = SiglipVisionConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=64,
        patch_size=16,
    )
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=token_ids["boi"],
        eoi_token_index=token_ids["eoi"],
        image_token_index=token_ids["image"],
        initializer_range=0.05,
    )
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    return cfg


ARCHITECTURES = [
    Architecture(
        family="gemma3",
        hf_names=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        parse=parse_gemma3,
        load_weights=load_gemma3_weights,
        model_class=Gemma3LM,
        hf_config=gemma3_config,
        image=True,
        lora_prefix="base_model.model.model.language_model.",
    )
]
