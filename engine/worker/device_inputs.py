"""A step's inputs on the model's device (DESIGN.md §10): built on the host (numpy), moved in
ONE packed host-to-device copy into buffers preallocated at their maximum size. On the CPU
nothing moves.

Every integer input of a step is a segment of one byte buffer: a pinned host copy and a
device copy of the same size, allocated once for the largest step (``max_tokens`` tokens,
``max_reqs`` sequences). A step's segments are packed from offset 0 (each 8-byte aligned) in
a fixed order, so the offsets depend only on the step's token and sequence counts: two
steps of the same shape read their inputs at the same device addresses (what a replayed
graph needs). The block table is fixed-width (``max_blocks`` columns per row, the request's
whole table), so its stride never changes either; columns past a sequence's blocks hold
ids an earlier step left there, and no kernel reads past a sequence's length.

The host buffer is rewritten by the next step: the step must have read its sampled ids back
(which waits for the copy, ordered before them on the stream) before the next ``move``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from epdserve.engine.worker.input_batch import StepInputs

ALIGN = 8  # bytes: every segment starts 8-byte aligned, so each dtype view is legal


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


def _segments(tokens: int, reqs: int, groups: int, max_blocks: int, samples: int, lora: bool):
    """``(name, dtype, shape)`` of a step's segments, in packing order."""
    out = [
        ("input_ids", torch.int64, (tokens,)),
        ("positions", torch.int64, (tokens,)),
        *((f"slots{g}", torch.int64, (tokens,)) for g in range(groups)),
        ("logits_indices", torch.int64, (samples,)),
        ("seq_lens", torch.int32, (reqs,)),
        ("query_start_loc", torch.int32, (reqs + 1,)),
        *((f"table{g}", torch.int32, (reqs, max_blocks)) for g in range(groups)),
    ]
    if lora:
        out.append(("lora_slots", torch.int32, (tokens,)))
    return out


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = int(np.prod(shape)) * dtype.itemsize
    return -(-n // ALIGN) * ALIGN


class DeviceInputs:
    def __init__(
        self,
        device: torch.device,
        max_tokens: int = 0,
        max_reqs: int = 0,
        max_blocks: int = 0,
        num_groups: int = 1,
        pin: bool | None = None,
    ):
        self.device = torch.device(device)
        self.max_blocks, self.num_groups = max_blocks, num_groups
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.capacity = sum(
            _nbytes(dt, shape)
            for _, dt, shape in _segments(
                max_tokens, max_reqs, num_groups, max_blocks, max_reqs, True
            )
        )
        self.host = self.dev = None  # allocated on the first packed move
        self.num_allocations = 0  # buffer allocations so far (1 unless a step outgrew them)

    def move(self, inputs: StepInputs, table_rows=None) -> DeviceStep:
        """``inputs`` on the device. ``table_rows`` (``[groups, max_reqs, max_blocks]`` int32
        numpy, the batch's whole tables) and ``inputs.rows`` give the fixed-width block table;
        without them the step's own (cut) table is used. On the CPU, ``inputs`` themselves."""
        if self.device.type == "cpu":
            return DeviceStep(
                inputs.input_ids,
                inputs.positions,
                inputs.slot_mapping,
                inputs.block_table,
                inputs.seq_lens,
                inputs.query_start_loc,
                inputs.logits_indices,
                inputs.lora_slots,
            )
        return self.pack(inputs, table_rows)

    def pack(self, inputs: StepInputs, table_rows=None) -> DeviceStep:
        """One packed copy of ``inputs`` (any device, the CPU included: tests)."""
        tokens, reqs = inputs.input_ids.shape[0], inputs.seq_lens.shape[0]
        width = self.max_blocks if table_rows is not None else inputs.block_table[0].shape[1]
        segs = _segments(
            tokens,
            reqs,
            len(inputs.block_table),
            width,
            inputs.logits_indices.shape[0],
            inputs.lora_slots is not None,
        )
        sizes = [_nbytes(dt, shape) for _, dt, shape in segs]
        end = sum(sizes)
        if self.host is None or end > self.host.numel():
            size = max(end, self.capacity)
            self.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.dev = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.num_allocations += 1
        views, off = {}, 0
        for (name, dt, shape), n in zip(segs, sizes, strict=True):
            count = int(np.prod(shape))
            host = self.host[off : off + n].view(dt)[:count].view(shape)
            self._fill(host, name, inputs, table_rows)
            views[name] = self.dev[off : off + n].view(dt)[:count].view(shape)
            off += n
        self.dev[:end].copy_(self.host[:end], non_blocking=self.pin)  # the step's one copy
        groups = range(len(inputs.block_table))
        return DeviceStep(
            views["input_ids"],
            views["positions"],
            [views[f"slots{g}"] for g in groups],
            [views[f"table{g}"] for g in groups],
            views["seq_lens"],
            views["query_start_loc"],
            views["logits_indices"],
            views.get("lora_slots"),
        )

    @staticmethod
    def _fill(host: torch.Tensor, name: str, inputs: StepInputs, table_rows) -> None:
        if name.startswith("table"):
            g = int(name[5:])
            if table_rows is None:
                host.copy_(inputs.block_table[g])
            else:  # the requests' whole rows: one gather straight into the pinned buffer
                np.take(table_rows[g], inputs.rows, axis=0, out=host.numpy())
            return
        if name.startswith("slots"):
            host.copy_(inputs.slot_mapping[int(name[5:])])
            return
        host.copy_(getattr(inputs, name))
