"""A step's inputs on the model's device: built on the host (numpy), copied through
preallocated pinned buffers with non-blocking copies. On the CPU nothing moves.

Each input keeps one pinned host buffer and one device buffer, grown on demand (doubling),
so a steady stream of steps allocates nothing. A step's copies are ordered on the current
stream before its forward; the step ends by reading the sampled ids back (the one host
sync per step), so the next step may reuse the host buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epdserve.engine.worker.input_batch import StepInputs


@dataclass
class DeviceStep:
    """The device copies of what the forward reads."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: list[torch.Tensor]
    block_table: list[torch.Tensor]
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    lora_slots: torch.Tensor | None = None


class DeviceInputs:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def move(self, inputs: StepInputs) -> DeviceStep:
        m = self._move
        return DeviceStep(
            m("input_ids", inputs.input_ids),
            m("positions", inputs.positions),
            [m(f"slots{g}", t) for g, t in enumerate(inputs.slot_mapping)],
            [m(f"table{g}", t) for g, t in enumerate(inputs.block_table)],
            m("seq_lens", inputs.seq_lens),
            m("query_start_loc", inputs.query_start_loc),
            m("logits_indices", inputs.logits_indices),
            None if inputs.lora_slots is None else m("lora_slots", inputs.lora_slots),
        )

    def _move(self, name: str, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host
        n = host.numel()
        pinned, dev = self._buffers.get(name, (None, None))
        if pinned is None or pinned.numel() < n or pinned.dtype != host.dtype:
            size = max(n, 2 * pinned.numel() if pinned is not None else 0, 1)
            pinned = torch.empty(size, dtype=host.dtype, pin_memory=True)
            dev = torch.empty(size, dtype=host.dtype, device=self.device)
            self._buffers[name] = (pinned, dev)
        pinned[:n].copy_(host.reshape(-1))
        out = dev[:n]
        out.copy_(pinned[:n], non_blocking=True)
        return out.view(host.shape)
