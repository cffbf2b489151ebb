"""Gemma3's text decoder, a ``DecoderLM``: scaled embeddings, GeGLU, sandwich norms around
attention and MLP (all norms ``(1 + w)`` in fp32), q/k norms, and interleaved sliding-window /
global layers with their own rope bases (the config's ``layer_types``). Image embeddings can
replace token embeddings (``inputs_embeds``), and image spans attend bidirectionally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.decoder import DecoderLM
from epdserve.engine.models.layers import ShardedWeights
from epdserve.kernels.backends import KernelBackend


class Gemma3LM(DecoderLM):
    """``DecoderLM`` with Gemma3's hooks; its config carries the rest (per-layer windows,
    q/k norms, ``query_pre_attn_scalar``, attention and final logit soft caps)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        kernels: KernelBackend | None = None,
    ):
        super().__init__(config, dtype, device, max_positions, kernels)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype)

    def layer_ropes(self, max_positions: int) -> list[torch.Tensor]:
        """A rope cache per attention kind (sliding layers: the local base)."""
        by_kind = {
            kind: self.rope_cache(params, max_positions)
            for kind, params in self.config.rope_by_layer_type.items()
        }
        return [by_kind[kind] for kind in self.config.layer_types]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embed_scale

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


def load_gemma3_weights(model: Gemma3LM, w: ShardedWeights) -> None:
    """This rank's slice of every weight (``w``: ``layers.ShardedWeights``); norms are fp32
    ``1 + w``."""
    model.embed = w.vocab("embed_tokens.weight")
    model.lm_head = model.embed
    model.final_norm = w.norm("norm.weight")
    for i, layer in enumerate(model.layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        layer.qkv_w = w.qkv(a)
        layer.o_w = w.row(a + "o_proj.weight", w.cfg.q_size)
        layer.q_norm, layer.k_norm = w.norm(a + "q_norm.weight"), w.norm(a + "k_norm.weight")
        layer.gate_up_w = torch.cat(
            [w.column(p + "mlp.gate_proj.weight"), w.column(p + "mlp.up_proj.weight")]
        )
        layer.down_w = w.row(p + "mlp.down_proj.weight", w.cfg.intermediate_size)
        layer.in_norm = w.norm(p + "input_layernorm.weight")
        layer.post_attn_norm = w.norm(p + "post_attention_layernorm.weight")
        layer.mlp_norm = w.norm(p + "pre_feedforward_layernorm.weight")
        layer.post_mlp_norm = w.norm(p + "post_feedforward_layernorm.weight")
