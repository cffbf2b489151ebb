"""Gemma3 text decoder: scaled embeddings, (1+w) RMSNorms in fp32, q/k norms, pre/post
feed-forward norms, GeGLU, and interleaved sliding-window / global layers with their own
rope bases. Same interface as ``DecoderLM``; image embeddings can replace token embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.engine.models.bidirectional import attend_spans
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.decoder import AttentionMetadata, per_layer, self_attention
from epdserve.engine.models.rope import cos_sin_cache
from epdserve.kernels.backends import KernelBackend, get_backend


class Gemma3Layer:
    __slots__ = (
        "qkv_w",
        "o_w",
        "gate_up_w",
        "down_w",
        "in_norm",
        "post_attn_norm",
        "pre_ff_norm",
        "post_ff_norm",
        "q_norm",
        "k_norm",
        "sliding",
        "rope",
    )


class Gemma3LM:
    """``forward(input_ids, meta, kv_caches, inputs_embeds=None) -> hidden``."""

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
        self.ropes = {
            kind: cos_sin_cache(params, config.head_dim, max_positions, torch.float32).to(
                device=device, dtype=dtype
            )
            for kind, params in config.rope_by_layer_type.items()
        }
        self.layers = []
        for kind in config.layer_types:
            layer = Gemma3Layer()
            layer.sliding = config.sliding_window if kind == "sliding_attention" else None
            layer.rope = self.ropes[kind]
            self.layers.append(layer)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype)
        self.embed = self.final_norm = self.lm_head = None

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed) * self.embed_scale

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cfg, rms_norm = self.config, self.kernels.rms_norm
        eps = cfg.rms_norm_eps
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        layers = zip(self.layers, kv_caches, per_layer(meta, len(self.layers)), strict=True)
        for layer, (k_cache, v_cache), meta in layers:
            residual = h
            x = rms_norm(h, layer.in_norm, eps)
            attn = self._attention(layer, x, meta, k_cache, v_cache)
            x, residual = rms_norm(
                rms_norm(attn, layer.post_attn_norm, eps), layer.pre_ff_norm, eps, residual
            )
            gate_up = F.linear(x, layer.gate_up_w)
            inter = cfg.intermediate_size
            mlp = F.linear(
                F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:], layer.down_w
            )
            h = residual + rms_norm(mlp, layer.post_ff_norm, eps)
        return h

    def _attention(self, layer: Gemma3Layer, x, meta: AttentionMetadata, k_cache, v_cache):
        cfg = self.config
        out, q = self_attention(
            self.kernels,
            cfg,
            F.linear(x, layer.qkv_w),
            meta,
            k_cache,
            v_cache,
            (layer.q_norm, layer.k_norm),
            layer.rope,
            self.scale,
            layer.sliding,
            cfg.attn_logit_softcap,
        )
        if meta.bidirectional_spans:
            attend_spans(out, q, k_cache, v_cache, meta, self.scale, layer.sliding)
        return F.linear(out.reshape(x.shape[0], cfg.q_size), layer.o_w)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.kernels.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        logits = F.linear(x, self.lm_head).float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def load_gemma3_weights(model: Gemma3LM, get, get_norm) -> None:
    """``get(name)`` returns a tensor in the model dtype; ``get_norm`` returns fp32 ``1 + w``."""
    model.embed = get("embed_tokens.weight")
    model.lm_head = model.embed
    model.final_norm = get_norm("norm.weight")
    for i, layer in enumerate(model.layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        layer.qkv_w = torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"])
        layer.o_w = get(a + "o_proj.weight")
        layer.q_norm, layer.k_norm = get_norm(a + "q_norm.weight"), get_norm(a + "k_norm.weight")
        layer.gate_up_w = torch.cat(
            [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]
        )
        layer.down_w = get(p + "mlp.down_proj.weight")
        layer.in_norm = get_norm(p + "input_layernorm.weight")
        layer.post_attn_norm = get_norm(p + "post_attention_layernorm.weight")
        layer.pre_ff_norm = get_norm(p + "pre_feedforward_layernorm.weight")
        layer.post_ff_norm = get_norm(p + "post_feedforward_layernorm.weight")
