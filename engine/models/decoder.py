"""Decoder-only transformer for the Llama / Mistral / Qwen2 / Qwen3 families.

Weights are fused at load time (q|k|v, gate|up) so each layer is four matmuls; attention
norms, rotary and attention go through the kernel backend chosen at load
(``epdserve.kernels.backends``), attention against the paged, cross-layer KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.rope import cos_sin_cache
from epdserve.kernels.backends import KernelBackend, get_backend


@dataclass
class AttentionMetadata:
    """Per-step batch geometry, built by the model runner."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [S, MB] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    # (sequence index, first position, end position) of image spans in this step's queries,
    # whose tokens attend to each other bidirectionally (Gemma3)
    bidirectional_spans: tuple[tuple[int, int, int], ...] = ()


class DecoderLayer:
    __slots__ = (
        "qkv_w",
        "qkv_b",
        "o_w",
        "gate_up_w",
        "down_w",
        "in_norm",
        "post_norm",
        "q_norm",
        "k_norm",
    )

    def __init__(self):
        self.qkv_b = self.q_norm = self.k_norm = None


class DecoderLM:
    """``forward(input_ids, meta, kv_caches) -> hidden``; ``compute_logits(hidden)``."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        kernels: KernelBackend | None = None,
    ):
        self.config = config
        self.dtype = dtype
        self.device = device
        self.kernels = kernels or get_backend(None, device)
        self.layers = [DecoderLayer() for _ in range(config.num_layers)]
        self.scale = config.head_dim**-0.5
        self.rope_cache = cos_sin_cache(
            config.rope, config.head_dim, max_positions, torch.float32
        ).to(device=device, dtype=dtype)
        self.embed = self.final_norm = self.lm_head = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        cfg, rms_norm = self.config, self.kernels.rms_norm
        h = F.embedding(input_ids, self.embed)
        residual = None
        layers = zip(self.layers, kv_caches, per_layer(meta, len(self.layers)), strict=True)
        for layer, (k_cache, v_cache), meta in layers:
            if residual is None:
                residual = h
                x = rms_norm(h, layer.in_norm, cfg.rms_norm_eps)
            else:
                x, residual = rms_norm(h, layer.in_norm, cfg.rms_norm_eps, residual)
            h = self._attention(layer, x, meta, k_cache, v_cache)
            x, residual = rms_norm(h, layer.post_norm, cfg.rms_norm_eps, residual)
            gate_up = F.linear(x, layer.gate_up_w)
            h = F.linear(
                F.silu(gate_up[:, : cfg.intermediate_size]) * gate_up[:, cfg.intermediate_size :],
                layer.down_w,
            )
        return h + residual  # final norm runs only on the rows that need logits

    def _attention(self, layer: DecoderLayer, x, meta, k_cache, v_cache) -> torch.Tensor:
        cfg = self.config
        qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
        norms = (layer.q_norm, layer.k_norm) if cfg.qk_norm else None
        out, _ = self_attention(
            self.kernels,
            cfg,
            qkv,
            meta,
            k_cache,
            v_cache,
            norms,
            self.rope_cache,
            self.scale,
            cfg.sliding_window,
        )
        return F.linear(out.reshape(x.shape[0], cfg.q_size), layer.o_w)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.kernels.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()


def per_layer(meta, num_layers: int) -> list[AttentionMetadata]:
    """Layers of different KV-cache groups get their own metadata (a list); one group shares."""
    return meta if isinstance(meta, list) else [meta] * num_layers


def self_attention(
    kernels: KernelBackend,
    cfg: ModelConfig,
    qkv: torch.Tensor,
    meta: AttentionMetadata,
    k_cache,
    v_cache,
    qk_norms,
    rope: torch.Tensor,
    scale: float,
    window=None,
    soft_cap=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fused q|k|v, apply per-head q/k norms (if given) and rope, write k/v into the
    paged cache, attend. Returns ``(out [T, H, D], q)``."""
    t = qkv.shape[0]
    q = qkv[:, : cfg.q_size].reshape(t, cfg.num_heads, cfg.head_dim)
    k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, cfg.q_size + cfg.kv_size :].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if qk_norms is not None:
        q = kernels.rms_norm(q.contiguous(), qk_norms[0], cfg.rms_norm_eps)
        k = kernels.rms_norm(k.contiguous(), qk_norms[1], cfg.rms_norm_eps)
    else:
        q, k = q.contiguous(), k.contiguous()
    q, k = kernels.rotary_embedding(meta.positions, q, k, rope, True)
    kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        sliding_window=window,
        soft_cap=soft_cap,
    )
    return out, q
