"""Torch twin of ``rotary_embedding`` (in-place RoPE on q and k)."""

from __future__ import annotations

import torch

from epdserve.kernels.checks import check_rotary


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
):
    """Rotate the first ``rot_dim`` dims of every head of ``q [T,H,D]`` and ``k [T,KVH,D]``.

    ``cos_sin_cache[max_pos, rot_dim]`` holds ``cos`` in its first half and ``sin`` in its
    second half (row = position). ``is_neox=True`` pairs dim ``i`` with ``i + rot_dim/2``
    (HF Llama/Qwen "rotate half"); ``False`` pairs ``2i`` with ``2i+1`` (GPT-J). Math is
    done in the tensors' dtype, each product rounded as HF's ``q * cos + rotate_half(q) *
    sin`` rounds it. Applied in place; returns ``(q, k)``.
    """
    check_rotary(positions, q, k, cos_sin_cache)
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2] each
    rot_dim = cos_sin_cache.shape[1]
    for t in (q, k):
        _rotate(t, cos, sin, rot_dim, is_neox)
    return q, k


def _rotate(t: torch.Tensor, cos, sin, rot_dim: int, is_neox: bool) -> None:
    half = rot_dim // 2
    if is_neox:
        x1, x2 = t[..., :half], t[..., half:rot_dim]
    else:
        x1, x2 = t[..., 0:rot_dim:2], t[..., 1:rot_dim:2]
    r1 = x1 * cos - x2 * sin  # in the tensors' dtype: bf16 rounds each product, as HF
    r2 = x2 * cos + x1 * sin
    x1.copy_(r1)
    x2.copy_(r2)
