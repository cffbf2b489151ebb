"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): a ``DecoderLM`` whose sparse
layers replace the MLP with a router, routed SwiGLU experts (the kernel backend's
``fused_moe``) and, where the family has one, a shared expert behind a sigmoid gate.

Routing is HF's: router logits in the model dtype, softmax in float32, the top ``k`` experts
per token, their weights renormalised to sum to 1 where ``norm_topk_prob``. Under tensor
parallelism each rank holds every expert's slice of the intermediate size (gate/up rows,
down columns) and of the shared expert's; the router and shared gate are replicated. The
routed and shared outputs are partial sums, scaled per token, so one all-reduce after the
block suffices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from epdserve.engine.models.decoder import DecoderLayer, DecoderLM
from epdserve.kernels.linear import linear, pack, packing_enabled

if TYPE_CHECKING:
    from epdserve.engine.lora.batch import LoRABatch


class MoeLayer(DecoderLayer):
    """A decoder layer that may be sparse: ``router_w [E, H]``, experts ``w13 [E, 2I, H]``
    (gate|up) and ``w2 [E, H, I]``; ``gate_up_w``/``down_w`` are the dense MLP of a dense
    layer, or the shared expert of a sparse one (gated by ``shared_gate_w [1, H]``)."""

    __slots__ = ("router_w", "w13", "w2", "shared_gate_w")

    def __init__(self, window: int | None, rope: torch.Tensor, index: int = 0):
        super().__init__(window, rope, index)
        self.router_w = self.w13 = self.w2 = self.shared_gate_w = None

    @property
    def is_sparse(self) -> bool:
        return self.router_w is not None


def route(logits: torch.Tensor, top_k: int, renormalise: bool):
    """``(weights [T, k] float32, ids [T, k] int64)``: the top ``k`` experts of each token by
    the float32 softmax of its router ``logits``; ``renormalise``: weights sum to 1."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoeLM(DecoderLM):
    """``DecoderLM`` with sparse layers (``config.layer_is_sparse``); LoRA does not apply
    (the architectures say so: ``lora_refusal``)."""

    def __init__(self, config, dtype, device, max_positions, kernels=None):
        super().__init__(config, dtype, device, max_positions, kernels)
        self.layers = [MoeLayer(la.window, la.rope, la.index) for la in self.layers]

    def pack_weights(self) -> None:
        """The dense products as ``DecoderLM`` packs them; experts become per-expert packed
        matrices only for the native backend's grouped path (the twin and Triton read the
        stacked tensors)."""
        super().pack_weights()
        for layer in self.layers:
            if layer.is_sparse and self.kernels.name == "native" and packing_enabled(layer.w13[0]):
                layer.w13 = [pack(w) for w in layer.w13.unbind(0)]
                layer.w2 = [pack(w) for w in layer.w2.unbind(0)]

    def _mlp(self, layer: MoeLayer, x: torch.Tensor, lora: LoRABatch | None = None):
        if not layer.is_sparse:
            return super()._mlp(layer, x, lora)
        cfg = self.config
        weights, ids = route(linear(x, layer.router_w), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        out = self.kernels.fused_moe(x, layer.w13, layer.w2, weights, ids)
        if layer.gate_up_w is not None:  # the shared expert, behind its sigmoid gate
            gate = torch.sigmoid(linear(x, layer.shared_gate_w))
            out = out + gate * self._gated_mlp(layer.gate_up_w, layer.down_w, x)
        return self.tp.all_reduce(out)

    def _gated_mlp(self, gate_up_w, down_w, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of a SwiGLU MLP (not reduced)."""
        gate_up = linear(x, gate_up_w)
        inter = gate_up.shape[1] // 2
        return linear(F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]), down_w)
