"""Reusable scratch buffers for the torch twins.

Fresh multi-megabyte CPU allocations are served by ``mmap`` and page-fault on first touch
(~5x slower than copying into warm memory), so the attention gathers reuse one grow-only
buffer per (thread, device, dtype, purpose). A buffer is only valid until the next call
that asks for the same purpose; nothing returned to a caller may alias it.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def scratch(purpose: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A contiguous tensor of ``shape`` backed by the reusable buffer named ``purpose``."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    numel = 1
    for n in shape:
        numel *= n
    # inference-mode tensors cannot be written outside inference mode (and vice versa is
    # wasteful), so each mode keeps its own buffers
    key = (purpose, torch.device(device), dtype, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        buffers[key] = buf
    return buf[:numel].view(shape)


def release_all() -> None:
    """Drop this thread's buffers (tests and memory-pressure handling)."""
    _local.buffers = {}
