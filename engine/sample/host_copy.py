"""A step's results to the host in one go: on CUDA, non-blocking copies into pinned buffers
and one event to wait on where the values are read; on the CPU the tensors themselves."""

from __future__ import annotations

import numpy as np
import torch


class HostCopy:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._buffers: list[torch.Tensor] = []  # one flat pinned buffer per slot, grown

    def start(self, *tensors: torch.Tensor) -> PendingCopy:
        """Start copying ``tensors`` to the host; read them with ``PendingCopy.wait``."""
        if not self.pinned:
            return PendingCopy([t.cpu() for t in tensors], None)
        views = []
        for slot, t in enumerate(tensors):
            buf = self._buffer(slot, t)
            view = buf[: t.numel()].view(t.shape)
            view.copy_(t, non_blocking=True)
            views.append(view)
        event = torch.cuda.Event()
        event.record()
        return PendingCopy(views, event)

    def _buffer(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0))
        buf = self._buffers[slot]
        if buf.dtype != t.dtype or buf.numel() < t.numel():
            size = max(t.numel(), 2 * buf.numel() if buf.dtype == t.dtype else 0, 256)
            buf = torch.empty(size, dtype=t.dtype, pin_memory=True)
            self._buffers[slot] = buf
        return buf


class PendingCopy:
    """Host tensors that are valid once ``wait`` returns. Pinned buffers are reused by the
    next ``start``: read (or copy) the arrays before then."""

    def __init__(self, tensors: list[torch.Tensor], event):
        self.tensors = tensors
        self.event = event

    def wait(self) -> list[np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return [t.numpy() for t in self.tensors]
