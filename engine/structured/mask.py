"""The model runner's side of structured outputs: a step's packed bitmask applied to logits.

Bit ``t % 32`` of word ``t // 32`` of a row allows token ``t`` (xgrammar's layout). xgrammar's
kernel applies it; plain torch where xgrammar is missing.
"""

from __future__ import annotations

import torch

try:
    from xgrammar import apply_token_bitmask_inplace
except ImportError:  # pragma: no cover - xgrammar ships with the engine extra
    apply_token_bitmask_inplace = None

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: bytes, num_rows: int) -> None:
    """Disallowed tokens of ``logits[rows[i]]`` become -inf (row ``i`` of ``bitmask``), and so
    does every column past the bitmask's vocabulary."""
    if not rows:
        return
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(num_rows, -1)
    words = words[: len(rows)]
    covered = words.shape[1] * 32
    if apply_token_bitmask_inplace is None:
        _apply_torch(logits, rows, words)
    else:
        full = torch.full((logits.shape[0], words.shape[1]), -1, dtype=torch.int32)
        full[rows] = words
        vocab = min(logits.shape[1], covered)
        apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=vocab, indices=rows)
    if logits.shape[1] > covered:  # logits wider than the grammar's vocabulary: padding
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits[index, covered:] = float("-inf")


def _apply_torch(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> None:
    dev = logits.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((words.to(dev).unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)
    vocab = min(logits.shape[1], allowed.shape[1])
    index = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits.index_select(0, index)
    sub[:, :vocab].masked_fill_(allowed[:, :vocab] == 0, float("-inf"))
    logits.index_copy_(0, index, sub)
