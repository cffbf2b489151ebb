"""The model runner's side of structured outputs: a step's packed bitmask applied to logits.

Bit ``t % 32`` of word ``t // 32`` of a row allows token ``t`` (xgrammar's layout). Plain
torch, so it runs wherever the logits are.
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: bytes, num_rows: int) -> None:
    """Disallowed tokens of ``logits[rows[i]]`` become -inf (row ``i`` of ``bitmask``)."""
    if not rows:
        return
    dev = logits.device
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(num_rows, -1)
    words = words[: len(rows)].to(dev, non_blocking=True)
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # logits wider than the grammar's vocabulary: padding
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits.index_select(0, index)
    sub.masked_fill_(allowed[:, :vocab] == 0, float("-inf"))
    logits.index_copy_(0, index, sub)
