"""One step's adapters, as the decoder applies them: a slot per token (-1: base model) and the
adapters' stacks. ``add`` adds the deltas of the modules whose outputs lie side by side in a
fused projection's output (q|k|v, gate|up), each on its column slice, with one call each to
``kernels.lora.lora_apply`` (``y += scaling[s] * (x @ A[s].T) @ B[s].T`` per row of slot
``s``; rows of slot -1 untouched).

A step with no adapter rows has no ``LoRABatch`` at all: base-only batches cost nothing.
"""

from __future__ import annotations

import torch

from epdserve.kernels.lora import lora_apply


class LoRABatch:
    def __init__(self, slots: torch.Tensor, stacks: list[dict], scaling: torch.Tensor):
        self.slots = slots  # int32 [T]
        self.stacks = stacks  # per layer: module -> (A [S, r, in], B [S, out, r])
        self.scaling = scaling  # float32 [S]

    def add(self, layer: int, modules: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        """``y`` (the fused output of ``modules``, side by side) += their adapters' deltas."""
        stacks = self.stacks[layer]
        start = 0
        for module in modules:
            a, b = stacks[module]
            end = start + b.shape[1]
            lora_apply(
                y if len(modules) == 1 else y[:, start:end], x, self.slots, a, b, self.scaling
            )
            start = end
