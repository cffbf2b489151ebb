"""Model configuration read from a HuggingFace ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

TEXT_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: dict = field(default_factory=dict)
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Gemma3: per-layer attention kinds, their rope settings, and its numerics
    layer_types: tuple[str, ...] = ()
    rope_by_layer_type: dict = field(default_factory=dict)
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    multimodal: dict = field(default_factory=dict)  # raw top-level config of an image+text model

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        if self.layer_types:
            return [
                self.sliding_window if kind == "sliding_attention" else None
                for kind in self.layer_types
            ]
        return [self.sliding_window] * self.num_layers


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json``; unsupported architectures raise naming what was found."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model: no config.json in {model_dir}")
    top = json.loads(path.read_text())
    archs = top.get("architectures") or []
    raw = top.get("text_config") or top
    arch = next((a for a in archs if a in TEXT_ARCHITECTURES), None)
    if arch is None:
        supported = ", ".join(sorted(TEXT_ARCHITECTURES))
        raise ValueError(
            f"model: unsupported architecture {archs or '(none)'}; supported: {supported}"
        )
    family = TEXT_ARCHITECTURES[arch]
    if family == "gemma3":
        return _gemma3(arch, raw, top)
    rope = dict(raw.get("rope_parameters") or {})
    if not rope:  # older configs: rope_theta + rope_scaling
        rope = dict(raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = raw.get("rope_theta", 10000.0)
    sliding = raw.get("sliding_window") if family == "mistral" else None
    if family == "qwen2" and raw.get("use_sliding_window"):
        sliding = raw.get("sliding_window")
    return ModelConfig(
        **_common_fields(arch, family, raw, raw.get("eos_token_id")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=rope,
        qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=sliding,
    )


def _common_fields(arch: str, family: str, raw: dict, eos) -> dict:
    """The fields every decoder family reads the same way."""
    heads = raw["num_attention_heads"]
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


def _gemma3(arch: str, raw: dict, top: dict) -> ModelConfig:
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
        **_common_fields(arch, "gemma3", raw, raw.get("eos_token_id", top.get("eos_token_id"))),
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
