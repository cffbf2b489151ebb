"""Mixture-of-experts weights: read stacked and sharded from a checkpoint, and the TP checks.

Experts are stored stacked, ``w13 [E, 2I, H]`` (each expert's gate rows, then its up rows)
and ``w2 [E, H, I]``. Checkpoints hold them per expert, as on the hub, under the family's
names (``ExpertNames``: Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen's
``mlp.experts.{e}.gate_proj/up_proj/down_proj``); transformers' in-memory layout, fused
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``, is read too.
At TP ``n`` a rank reads its ``I / n`` gate/up rows and down columns of every expert (and of
a shared expert); routers and the shared expert's gate are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from epdserve.engine.models.arch.base import load_attention, load_embeddings, load_gated_mlp
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.layers import Shard, ShardedWeights


@dataclass(frozen=True)
class ExpertNames:
    """Where a family keeps a sparse block's tensors, under the layer's prefix."""

    block: str  # "block_sparse_moe." or "mlp."
    gate: str  # an expert's gate projection, e.g. "w1"
    up: str
    down: str
    router: str = "gate.weight"


MIXTRAL = ExpertNames("block_sparse_moe.", "w1", "w3", "w2")
QWEN = ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj")
FUSED_BLOCK = "mlp."  # transformers' in-memory names, whatever the family


def check_moe_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Refuse a TP size that does not divide the experts' (or the shared expert's)
    intermediate size (``ValueError`` naming the flag)."""
    if not cfg.is_moe:
        return
    for what, size in (
        ("expert intermediate size", cfg.moe_intermediate_size),
        ("shared expert intermediate size", cfg.shared_expert_intermediate_size),
    ):
        if size % tp:
            raise ValueError(
                f"tensor_parallel_size: {tp} does not divide the model's {what} {size}"
            )


def moe_shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """One rank's expert sizes (``layers.shard_config`` does heads and the dense MLP)."""
    return replace(
        cfg,
        moe_intermediate_size=cfg.moe_intermediate_size // shard.size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // shard.size,
    )


def _rows(w: ShardedWeights, name: str, size: int) -> torch.Tensor:
    """This rank's share of the ``size`` output rows of ``name`` (column-parallel)."""
    start, end = w.shard.split(size)
    return w.reader.get_slice(w.prefix + name)[start:end]


def _cols(w: ShardedWeights, name: str, size: int) -> torch.Tensor:
    """This rank's share of the ``size`` input columns of ``name`` (row-parallel)."""
    start, end = w.shard.split(size)
    return w.reader.get_slice(w.prefix + name)[:, start:end]


def _to(w: ShardedWeights, t: torch.Tensor) -> torch.Tensor:
    return t.to(device=w.device, dtype=w.dtype).contiguous()


def load_experts(layer, prefix: str, w: ShardedWeights, names: ExpertNames) -> None:
    """A sparse layer's router and stacked experts (``prefix``: the layer's ``layers.{i}.``)."""
    cfg = w.cfg
    inter, e = cfg.moe_intermediate_size, cfg.num_experts
    fused = prefix + FUSED_BLOCK + "experts."
    if w.reader.has(w.prefix + fused + "gate_up_proj"):
        start, end = w.shard.split(inter)
        gate_up = w.reader.get_slice(w.prefix + fused + "gate_up_proj")
        w13 = torch.cat([gate_up[:, start:end], gate_up[:, inter + start : inter + end]], 1)
        w2 = w.reader.get_slice(w.prefix + fused + "down_proj")[:, :, start:end]
        layer.router_w = w.full(prefix + FUSED_BLOCK + names.router)
    else:
        block = prefix + names.block
        experts = [f"{block}experts.{i}." for i in range(e)]
        w13 = torch.stack(
            [
                torch.cat(
                    [
                        _rows(w, p + f"{names.gate}.weight", inter),
                        _rows(w, p + f"{names.up}.weight", inter),
                    ]
                )  # fmt: skip
                for p in experts
            ]
        )
        w2 = torch.stack([_cols(w, p + f"{names.down}.weight", inter) for p in experts])
        layer.router_w = w.full(block + names.router)
    layer.w13, layer.w2 = _to(w, w13), _to(w, w2)


def load_shared_expert(layer, mlp: str, w: ShardedWeights) -> None:
    """Qwen2-MoE's shared expert (``mlp``: the layer's ``...mlp.`` prefix) and its gate."""
    size = w.cfg.shared_expert_intermediate_size
    p = mlp + "shared_expert."
    gate_up = torch.cat(
        [_rows(w, p + "gate_proj.weight", size), _rows(w, p + "up_proj.weight", size)]
    )
    layer.gate_up_w = _to(w, gate_up)
    layer.down_w = _to(w, _cols(w, p + "down_proj.weight", size))
    layer.shared_gate_w = w.full(mlp + "shared_expert_gate.weight")


def moe_weight_loader(names: ExpertNames):
    """The ``Architecture.load_weights`` of a family that keeps its experts as ``names``
    says: embeddings, attention and norms as Llama's; per layer a sparse block or a dense
    MLP (``config.layer_is_sparse``), and a shared expert where the config has one."""

    def load(model, w: ShardedWeights) -> None:
        cfg = w.cfg
        load_embeddings(model, w)
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            load_attention(layer, p + "self_attn.", w)
            layer.in_norm = w.full(p + "input_layernorm.weight")
            layer.mlp_norm = w.full(p + "post_attention_layernorm.weight")
            if not cfg.layer_is_sparse(i):
                load_gated_mlp(layer, p + "mlp.", w)
                continue
            load_experts(layer, p, w, names)
            if cfg.shared_expert_intermediate_size:
                load_shared_expert(layer, p + "mlp.", w)
        model.config = moe_shard_config(model.config, w.shard)

    return load
