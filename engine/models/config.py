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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json``; unsupported architectures raise naming what was found."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model: no config.json in {model_dir}")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in TEXT_ARCHITECTURES), None)
    if arch is None:
        supported = ", ".join(sorted(TEXT_ARCHITECTURES))
        raise ValueError(
            f"model: unsupported architecture {archs or '(none)'}; supported: {supported}"
        )
    family = TEXT_ARCHITECTURES[arch]
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    rope = dict(raw.get("rope_parameters") or {})
    if not rope:  # older configs: rope_theta + rope_scaling
        rope = dict(raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = raw.get("rope_theta", 10000.0)
    sliding = raw.get("sliding_window") if family == "mistral" else None
    if family == "qwen2" and raw.get("use_sliding_window"):
        sliding = raw.get("sliding_window")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=rope,
        qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=sliding,
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
    )
