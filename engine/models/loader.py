"""Load HF safetensors checkpoints (single file or sharded index) into a ``DecoderLM``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from epdserve.engine.models.config import architecture_of, load_model_config
from epdserve.engine.models.layers import (
    Shard,
    ShardedWeights,
    check_tensor_parallel,
    shard_config,
)
from epdserve.engine.models.quant import for_model as quantization_for
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
    quantization: str | None = None,
):
    """The decoder of ``model_dir`` on ``device``, its kernels from ``attention_backend``
    (``triton`` | ``native`` | ``torch``; None: ``backends.default_backend(device)``); under
    a tensor-parallel group ``tp``, this rank's slice of it (``layers``). A quantized
    checkpoint's linear layers stay quantized (``models.quant``; ``quantization``: the
    engine setting, None: the checkpoint's ``quantization_config`` decides)."""
    config = load_model_config(model_dir)
    quant = quantization_for(config, quantization)
    tp = tp or TPGroup()
    shard = Shard(tp.rank, tp.size)
    check_tensor_parallel(config, tp.size)
    kernels = get_backend(attention_backend, device)
    reader = CheckpointReader(model_dir)
    w = ShardedWeights(reader, _prefix(reader), config, shard, dtype, device, quant)
    arch = architecture_of(config)
    model = arch.model_cls()(shard_config(config, shard), dtype, device, max_positions, kernels)
    model.tp, model.vocab_start = tp, shard.vocab(config.vocab_size)[0]
    arch.load_weights(model, w)
    model.pack_weights()
    return model


def _prefix(reader: CheckpointReader) -> str:
    for candidate in ("model.", "model.language_model.", "language_model.model.", ""):
        if reader.has(candidate + "embed_tokens.weight"):
            return candidate
    raise ValueError("model: checkpoint is missing tensor 'model.embed_tokens.weight'")


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
