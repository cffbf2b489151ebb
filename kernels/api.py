"""Public kernel API: each op dispatches to Triton on CUDA tensors, to its torch twin otherwise
(rotary and RMSNorm: to the C kernels of ``native.py`` where they take the tensors).

``<op>_ref`` is the torch twin, ``<op>_triton`` the Triton launcher. Triton is imported
lazily (inside the launchers), so this module imports without triton installed. Set
``TRITON_INTERPRET=1`` before the first launcher call to run the Triton code on CPU tensors.
The engine's model does not dispatch here for attention and cache writes: it calls the
backend chosen at load (``backends.py``: ``triton``, ``native`` or ``torch``).
"""

from __future__ import annotations

import torch

from epdserve.kernels import native
from epdserve.kernels.attention_ref import paged_attention_ref
from epdserve.kernels.cache_ref import reshape_and_cache_ref
from epdserve.kernels.checks import check_rms_norm, check_rotary
from epdserve.kernels.norm_ref import rms_norm_ref
from epdserve.kernels.rotary_ref import rotary_embedding_ref

__all__ = [
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_triton",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "reshape_and_cache_triton",
    "rms_norm",
    "rms_norm_ref",
    "rms_norm_triton",
    "rotary_embedding",
    "rotary_embedding_ref",
    "rotary_embedding_triton",
]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention over a mixed batch; ``out[T, H, D]``.

    Sequence ``i`` owns queries ``query_start_loc[i]:query_start_loc[i+1]``, the last
    ``q_len`` positions of its ``seq_lens[i]``-token context; see ``attention_ref`` for the
    cache layout, GQA, ``sliding_window`` and ``soft_cap`` semantics.
    """
    impl = paged_attention_triton if query.is_cuda else paged_attention_ref
    return impl(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                sliding_window, soft_cap)  # fmt: skip


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t`` of ``key``/``value`` to slot ``slot_mapping[t]`` (-1 is skipped)."""
    impl = reshape_and_cache_triton if key.is_cuda else reshape_and_cache_ref
    impl(key, value, key_cache, value_cache, slot_mapping)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """RMSNorm computed in fp32; with ``residual`` returns ``(norm(x + residual), x + residual)``.

    On CPUs the C kernel (``native.py``) runs it where it takes the tensors, bit for bit the
    torch twin's result; else the twin."""
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps, residual)
    check_rms_norm(x, weight, eps, residual)
    if native.rms_norm_supports(x, weight, residual):
        return native.rms_norm(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
):
    """Rotary embedding applied in place to ``q [T,H,D]`` and ``k [T,KVH,D]``; returns both.

    On CPUs the C kernel (``native.py``) runs it when it takes the tensors (bfloat16 or
    float32, contiguous), with the torch twin's rounding; else the twin."""
    if q.is_cuda:
        return rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox)
    check_rotary(positions, q, k, cos_sin_cache)
    if native.rotary_supports(positions, q, k, cos_sin_cache):
        return native.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)


def paged_attention_triton(*args, **kwargs) -> torch.Tensor:
    """Triton launcher of ``paged_attention`` (same arguments)."""
    from epdserve.kernels.attention_triton import paged_attention_triton as launch

    return launch(*args, **kwargs)


def reshape_and_cache_triton(*args, **kwargs) -> None:
    """Triton launcher of ``reshape_and_cache`` (same arguments)."""
    from epdserve.kernels.cache_triton import reshape_and_cache_triton as launch

    return launch(*args, **kwargs)


def rms_norm_triton(*args, **kwargs):
    """Triton launcher of ``rms_norm`` (same arguments)."""
    from epdserve.kernels.norm_triton import rms_norm_triton as launch

    return launch(*args, **kwargs)


def rotary_embedding_triton(*args, **kwargs):
    """Triton launcher of ``rotary_embedding`` (same arguments)."""
    from epdserve.kernels.rotary_triton import rotary_embedding_triton as launch

    return launch(*args, **kwargs)
