"""What the architecture modules share: config fields read the same way, the Llama-style
weight layout (fused q|k|v and gate|up), and make-model's tiny sizes. Declares no
architecture itself."""

from __future__ import annotations

import torch

from epdserve.engine import serving_shapes
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.layers import ShardedWeights

VOCAB = 4096  # make-model's tokenizer (the tiny presets)
# make-model presets: (hidden, layers, heads, kv_heads, head_dim, intermediate)
SIZES = {"tiny": (128, 4, 4, 2, 32, 384), "small": (768, 8, 12, 4, 64, 2048)}
SIZES.update(serving_shapes.SHAPES)  # the shapes users serve (bf16, written tensor by tensor)
SIZES.update(serving_shapes.MOE_SHAPES)
SERVED = tuple(serving_shapes.SHAPES)
SERVED_MOE = tuple(serving_shapes.MOE_SHAPES)


def common_fields(arch: str, family: str, raw: dict, eos=None) -> dict:
    """The fields every decoder family reads the same way (``eos``: where the family keeps
    its eos id, default the text config's)."""
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id") if eos is None else eos
    return dict(
        architecture=arch,
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        bos_token_id=raw.get("bos_token_id"),
    )


def rope_params(raw: dict) -> dict:
    """``rope_parameters``, or the older ``rope_theta`` + ``rope_scaling`` as one dict."""
    rope = dict(raw.get("rope_parameters") or {})
    if not rope:
        rope = dict(raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = raw.get("rope_theta", 10000.0)
    return rope


def dense_config(arch: str, family: str, raw: dict, **fields) -> ModelConfig:
    """A Llama-style config: common fields, rope, tied embeddings as the config says, plus
    ``fields``."""
    fields.setdefault("tie_word_embeddings", bool(raw.get("tie_word_embeddings", False)))
    fields.setdefault("qkv_bias", bool(raw.get("attention_bias", False)))
    return ModelConfig(**common_fields(arch, family, raw), rope=rope_params(raw), **fields)


def load_embeddings(model, w: ShardedWeights) -> None:
    """Embedding, final norm and LM head (the embedding where tied)."""
    cfg = w.cfg
    model.embed = w.vocab("embed_tokens.weight")
    model.final_norm = w.full("norm.weight")
    if w.reader.has("lm_head.weight") and not cfg.tie_word_embeddings:
        unprefixed = ShardedWeights(w.reader, "", cfg, w.shard, w.dtype, w.device)
        model.lm_head = unprefixed.vocab("lm_head.weight")
    elif cfg.tie_word_embeddings:
        model.lm_head = model.embed
    else:
        raise ValueError("model: checkpoint is missing tensor 'lm_head.weight'")


def load_attention(layer, attn: str, w: ShardedWeights) -> None:
    """q|k|v fused from separate projections, o, and the q/k norms where the config has
    them (``attn``: the layer's ``...self_attn.`` prefix)."""
    cfg = w.cfg
    layer.qkv_w = w.qkv(attn, "weight")
    if cfg.qkv_bias:
        layer.qkv_b = w.qkv(attn, "bias")
    layer.o_w = w.row(attn + "o_proj.weight", cfg.q_size)
    if cfg.qk_norm:
        layer.q_norm = w.full(attn + "q_norm.weight")
        layer.k_norm = w.full(attn + "k_norm.weight")


def load_gated_mlp(layer, mlp: str, w: ShardedWeights) -> None:
    """gate|up fused from separate projections, and down (``mlp``: the ``...mlp.`` prefix)."""
    layer.gate_up_w = torch.cat(
        [w.column(mlp + "gate_proj.weight"), w.column(mlp + "up_proj.weight")]
    )
    layer.down_w = w.row(mlp + "down_proj.weight", w.cfg.intermediate_size)


def load_llama_weights(model, w: ShardedWeights) -> None:
    """The Llama layout: per layer, attention, a gated MLP and the two norms."""
    load_embeddings(model, w)
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        load_attention(layer, p + "self_attn.", w)
        load_gated_mlp(layer, p + "mlp.", w)
        layer.in_norm = w.full(p + "input_layernorm.weight")
        layer.mlp_norm = w.full(p + "post_attention_layernorm.weight")  # the norm before the MLP


def tiny_kwargs(preset: str, family: str, **overrides) -> dict:
    """The transformers config arguments of a make-model checkpoint of ``preset``; the served
    shapes (``serving_shapes``) then take their real configs' fields."""
    hidden, layers, heads, kv, _, inter = SIZES[preset]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    if preset in serving_shapes.SHAPES or preset in serving_shapes.MOE_SHAPES:
        kw.update(serving_shapes.config_overrides(family, preset))
    return kw


def head_dim(preset: str) -> int:
    return SIZES[preset][4]


def with_architecture(config, hf_name: str):
    """``config`` naming ``hf_name`` as its architecture (make-model)."""
    config.architectures = [hf_name]
    return config
