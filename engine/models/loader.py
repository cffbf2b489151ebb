"""Load HF safetensors checkpoints (single file or sharded index) into a ``DecoderLM``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from epdserve.engine.models.config import ModelConfig, load_model_config
from epdserve.engine.models.decoder import DecoderLM
from epdserve.engine.models.gemma3 import Gemma3LM, load_gemma3_weights
from epdserve.engine.models.layers import (
    Shard,
    ShardedWeights,
    check_tensor_parallel,
    shard_config,
)
from epdserve.engine.worker.parallel import TPGroup
from epdserve.kernels.backends import get_backend


class CheckpointReader:
    """Tensor lookup by name across the checkpoint's safetensors files."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
        if not files:
            raise ValueError(f"model: no safetensors weights in {model_dir}")
        self.handles = [safe_open(str(model_dir / f), framework="pt") for f in files]
        self.where = {name: h for h in self.handles for name in h.keys()}  # noqa: SIM118

    def has(self, name: str) -> bool:
        return name in self.where

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in self.where if n.startswith(prefix))

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"model: checkpoint is missing tensor {name!r}")
        return self.where[name].get_tensor(name)

    def get_slice(self, name: str):
        """A lazy view of ``name``: indexing it reads only those rows/columns."""
        if name not in self.where:
            raise ValueError(f"model: checkpoint is missing tensor {name!r}")
        return self.where[name].get_slice(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    attention_backend: str | None = None,
    tp: TPGroup | None = None,
):
    """The decoder of ``model_dir`` on ``device``, its kernels from ``attention_backend``
    (``triton`` | ``native`` | ``torch``; None: ``backends.default_backend(device)``); under
    a tensor-parallel group ``tp``, this rank's slice of it (``layers``)."""
    config = load_model_config(model_dir)
    tp = tp or TPGroup()
    shard = Shard(tp.rank, tp.size)
    check_tensor_parallel(config, tp.size)
    kernels = get_backend(attention_backend, device)
    reader = CheckpointReader(model_dir)
    w = ShardedWeights(reader, _prefix(reader), config, shard, dtype, device)
    cls = Gemma3LM if config.family == "gemma3" else DecoderLM
    model = cls(shard_config(config, shard), dtype, device, max_positions, kernels)
    model.tp, model.vocab_start = tp, shard.vocab(config.vocab_size)[0]
    if config.family == "gemma3":
        load_gemma3_weights(model, w)
        model.pack_weights()
        return model
    model.embed = w.vocab("embed_tokens.weight")
    model.final_norm = w.full("norm.weight")
    if reader.has("lm_head.weight") and not config.tie_word_embeddings:
        model.lm_head = ShardedWeights(reader, "", config, shard, dtype, device).vocab(
            "lm_head.weight"
        )
    elif config.tie_word_embeddings:
        model.lm_head = model.embed
    else:
        raise ValueError("model: checkpoint is missing tensor 'lm_head.weight'")
    for i, layer in enumerate(model.layers):
        _load_layer(layer, f"layers.{i}.", w, config)
    model.pack_weights()
    return model


def _prefix(reader: CheckpointReader) -> str:
    for candidate in ("model.", "model.language_model.", "language_model.model.", ""):
        if reader.has(candidate + "embed_tokens.weight"):
            return candidate
    raise ValueError("model: checkpoint is missing tensor 'model.embed_tokens.weight'")


def _load_layer(layer, p: str, w: ShardedWeights, config: ModelConfig) -> None:
    """One layer's weights, this rank's slices (``config``: the whole model's)."""
    attn = p + "self_attn."
    layer.qkv_w = w.qkv(attn, "weight")
    if config.qkv_bias:
        layer.qkv_b = w.qkv(attn, "bias")
    layer.o_w = w.row(attn + "o_proj.weight", config.q_size)
    if config.qk_norm:
        layer.q_norm = w.full(attn + "q_norm.weight")
        layer.k_norm = w.full(attn + "k_norm.weight")
    layer.gate_up_w = torch.cat(
        [w.column(p + "mlp.gate_proj.weight"), w.column(p + "mlp.up_proj.weight")]
    )
    layer.down_w = w.row(p + "mlp.down_proj.weight", config.intermediate_size)
    layer.in_norm = w.full(p + "input_layernorm.weight")
    layer.mlp_norm = w.full(p + "post_attention_layernorm.weight")  # the norm before the MLP


def load_vision_encoder(model_dir: str | Path, dtype: torch.dtype, device: torch.device):
    """The image encoder of an image+text checkpoint, or None for a text-only model."""
    from epdserve.engine.models.siglip import VisionConfig, VisionEncoder

    config = load_model_config(model_dir)
    if not config.multimodal:
        return None
    reader = CheckpointReader(model_dir)

    def get(name: str) -> torch.Tensor:
        return reader.get(name).to(device=device, dtype=dtype).contiguous()

    get.has, get.names = reader.has, reader.names
    return VisionEncoder(VisionConfig.from_hf(config.multimodal), get, dtype)
