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
        return F.embedding(input_ids, self.embed) * self.embed_scale

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


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
        layer.mlp_norm = get_norm(p + "pre_feedforward_layernorm.weight")
        layer.post_mlp_norm = get_norm(p + "post_feedforward_layernorm.weight")
