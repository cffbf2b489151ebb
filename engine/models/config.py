"""Model configuration read from a HuggingFace ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path


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
    # mixture of experts (num_experts 0: dense): routed experts, each token's top-k, their
    # intermediate size, whether the top-k weights are renormalised, a shared expert's size
    # (0: none), and which layers are sparse (empty: all of them)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()
    # the checkpoint's raw quantization_config ({}: unquantized weights)
    quantization: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # what one architecture alone reads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_sparse(self, index: int) -> bool:
        if not self.is_moe:
            return False
        return self.sparse_layers[index] if self.sparse_layers else True

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
    """Parse ``config.json`` with its architecture's reader (``models.arch``); an
    unregistered architecture raises naming what was found and what is supported."""
    from epdserve.engine.models import arch as registry

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model: no config.json in {model_dir}")
    top = json.loads(path.read_text())
    archs = top.get("architectures") or []
    found = registry.for_hf_names(archs)
    if found is None:
        supported = ", ".join(registry.supported_hf_names())
        raise ValueError(
            f"model: unsupported architecture {archs or '(none)'}; supported: {supported}"
        )
    name, architecture = found
    config = architecture.parse(name, top.get("text_config") or top, top)
    quantization = top.get("quantization_config") or {}
    return replace(config, quantization=quantization) if quantization else config


def architecture_of(config: ModelConfig):
    """The registry's ``Architecture`` of a parsed config."""
    from epdserve.engine.models import arch as registry

    return registry.by_family(config.family)
