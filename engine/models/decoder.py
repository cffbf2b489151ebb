"""Decoder-only transformer: the Llama / Mistral / Qwen2 / Qwen3 families, and the base of
``Gemma3LM``.

Weights are fused at load time (q|k|v, gate|up) so each layer is four matmuls; norms, rotary
and attention go through the kernel backend chosen at load (``epdserve.kernels.backends``),
attention against the paged, cross-layer KV cache. What a family changes, it changes through
the config (per-layer sliding windows, q/k norms, attention scale, logit soft caps), the
layer's optional sandwich norms, or a hook method: ``layer_ropes``, ``embed_tokens``,
``activation``. LoRA adapters (the step's ``meta.lora``) add their deltas to the q/k/v, o,
gate/up and down projections' outputs, per token's adapter slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from epdserve.engine.models.bidirectional import ImageSpans, attend_spans
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.layers import gathered_logits, inference, vocab_embedding
from epdserve.engine.models.rope import cos_sin_cache
from epdserve.engine.worker.parallel import TPGroup
from epdserve.kernels.backends import KernelBackend, get_backend
from epdserve.kernels.linear import linear, pack

if TYPE_CHECKING:
    from epdserve.engine.lora.batch import LoRABatch


@dataclass
class AttentionMetadata:
    """Per-step batch geometry, built by the model runner."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [S, MB] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    # image spans in this step's queries, whose tokens attend to each other bidirectionally
    # (Gemma3): ImageSpans built on the host once per step (raw (sequence index, first
    # position, end position) triples only on host metadata, in direct model tests)
    bidirectional_spans: ImageSpans | tuple[tuple[int, int, int], ...] = ()
    lora: LoRABatch | None = None  # the step's adapters; None: every row is the base model
    # what kernels derive from this step's geometry, derived by the first layer and reused by
    # the others (the attention backends' ``step_cache``); a new metadata starts empty
    step_cache: dict = field(default_factory=dict)


class DecoderLayer:
    """One layer's weights, its sliding window (None: full attention) and rope cache.

    ``mlp_norm`` is the norm before the MLP; ``post_attn_norm`` / ``post_mlp_norm`` are the
    sandwich norms of the families that have them (Gemma3), else None."""

    __slots__ = (
        "qkv_w",
        "qkv_b",
        "o_w",
        "gate_up_w",
        "down_w",
        "in_norm",
        "mlp_norm",
        "post_attn_norm",
        "post_mlp_norm",
        "q_norm",
        "k_norm",
        "window",
        "rope",
        "index",
    )

    def __init__(self, window: int | None, rope: torch.Tensor, index: int = 0):
        self.qkv_w = self.qkv_b = self.o_w = self.gate_up_w = self.down_w = None
        self.in_norm = self.mlp_norm = self.post_attn_norm = self.post_mlp_norm = None
        self.q_norm = self.k_norm = None
        self.window, self.rope, self.index = window, rope, index


class DecoderLM:
    """``forward(input_ids, meta, kv_caches, inputs_embeds=None) -> hidden``;
    ``compute_logits(hidden)``. ``inputs_embeds`` (image embeddings placed among the token
    embeddings) replaces ``embed_tokens(input_ids)``."""

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
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        ropes = self.layer_ropes(max_positions)
        self.layers = [
            DecoderLayer(window, rope, i)
            for i, (window, rope) in enumerate(zip(config.layer_windows(), ropes, strict=True))
        ]
        self.embed = self.final_norm = self.lm_head = None
        self.tp = TPGroup()  # the loader sets a rank's group, and its vocab rows' start
        self.vocab_start = 0

    # -- hooks: what a family changes --

    def layer_ropes(self, max_positions: int) -> list[torch.Tensor]:
        """Each layer's cos|sin cache: one cache shared by every layer."""
        return [self.rope_cache(self.config.rope, max_positions)] * self.config.num_layers

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_embedding(input_ids, self.embed, self.vocab_start, self.tp)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        """The gated MLP's activation (SwiGLU: SiLU)."""
        return F.silu(gate)

    def pack_weights(self) -> None:
        """Prepack the matrix products' weights for the device's kernels (``kernels.linear``):
        each layer's four, and the LM head unless it is the (tied) embedding."""
        for layer in self.layers:
            layer.qkv_w, layer.o_w = pack(layer.qkv_w), pack(layer.o_w)
            layer.gate_up_w, layer.down_w = pack(layer.gate_up_w), pack(layer.down_w)
        if self.lm_head is not self.embed:
            self.lm_head = pack(self.lm_head)

    # -- the model --

    def rope_cache(self, params: dict, max_positions: int) -> torch.Tensor:
        cache = cos_sin_cache(params, self.config.head_dim, max_positions, torch.float32)
        return cache.to(device=self.device, dtype=self.dtype)

    @inference
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rms_norm, eps = self.kernels.rms_norm, self.config.rms_norm_eps
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None  # the residual stream is h + residual; norms fuse the add
        layers = zip(self.layers, kv_caches, per_layer(meta, len(self.layers)), strict=True)
        for layer, (k_cache, v_cache), meta in layers:
            if residual is None:
                residual = h
                x = rms_norm(h, layer.in_norm, eps)
            else:
                x, residual = rms_norm(h, layer.in_norm, eps, residual)
            h = self._attention(layer, x, meta, k_cache, v_cache)
            if layer.post_attn_norm is not None:
                h = rms_norm(h, layer.post_attn_norm, eps)
            x, residual = rms_norm(h, layer.mlp_norm, eps, residual)
            h = self._mlp(layer, x, meta.lora)
            if layer.post_mlp_norm is not None:
                h = rms_norm(h, layer.post_mlp_norm, eps)
        return h + residual  # final norm runs only on the rows that need logits

    def _attention(self, layer: DecoderLayer, x, meta, k_cache, v_cache) -> torch.Tensor:
        cfg = self.config
        qkv = linear(x, layer.qkv_w, layer.qkv_b)
        if meta.lora is not None:
            meta.lora.add(layer.index, ("q_proj", "k_proj", "v_proj"), x, qkv)
        norms = (layer.q_norm, layer.k_norm) if cfg.qk_norm else None
        out, q = self_attention(
            self.kernels,
            cfg,
            qkv,
            meta,
            k_cache,
            v_cache,
            norms,
            layer.rope,
            self.scale,
            layer.window,
            cfg.attn_logit_softcap,
        )
        if meta.bidirectional_spans:
            attend_spans(out, q, k_cache, v_cache, meta, self.scale, layer.window)
        out = out.reshape(x.shape[0], cfg.q_size)
        o = linear(out, layer.o_w)
        if meta.lora is not None:
            meta.lora.add(layer.index, ("o_proj",), out, o)
        return self.tp.all_reduce(o)  # row-parallel: the ranks' partial sums

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor, lora: LoRABatch | None = None):
        gate_up = linear(x, layer.gate_up_w)
        inter = self.config.intermediate_size
        if lora is not None:
            lora.add(layer.index, ("gate_proj", "up_proj"), x, gate_up)
        h = self.activation(gate_up[:, :inter]).mul_(gate_up[:, inter:])  # one new tensor
        down = linear(h, layer.down_w)
        if lora is not None:
            lora.add(layer.index, ("down_proj",), h, down)
        return self.tp.all_reduce(down)

    @inference
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float logits ``[T, V]``; on a rank other than the output rank, None (every rank
        must call it: the vocab slices are gathered)."""
        x = self.kernels.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        logits = gathered_logits(linear(x, self.lm_head), self.config.vocab_size, self.tp)
        if logits is None:
            return None
        logits = logits.float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


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
        step_cache=meta.step_cache,
    )
    return out, q
