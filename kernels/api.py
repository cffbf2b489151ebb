"""Public kernel API: each op dispatches to Triton on CUDA tensors, to its torch twin otherwise.

``<op>_ref`` is the torch twin, ``<op>_triton`` the Triton launcher. Triton is imported
lazily (inside the launchers), so this module imports without triton installed. Set
``TRITON_INTERPRET=1`` before the first launcher call to run the Triton code on CPU tensors.
"""

from __future__ import annotations

import torch

from epdserve.kernels.attention_ref import paged_attention_ref
from epdserve.kernels.cache_ref import reshape_and_cache_ref
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


def paged_attention(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Causal paged attention (see ``epdserve.kernels.attention_ref`` for the semantics)."""
    if query.is_cuda:
        return paged_attention_triton(query, *args, **kwargs)
    return paged_attention_ref(query, *args, **kwargs)


def reshape_and_cache(key: torch.Tensor, *args, **kwargs) -> None:
    """Scatter ``key``/``value`` tokens into the paged cache by ``slot_mapping`` (-1 skipped)."""
    if key.is_cuda:
        return reshape_and_cache_triton(key, *args, **kwargs)
    return reshape_and_cache_ref(key, *args, **kwargs)


def rms_norm(x: torch.Tensor, *args, **kwargs):
    """RMSNorm in fp32; with ``residual`` returns ``(out, x + residual)``."""
    if x.is_cuda:
        return rms_norm_triton(x, *args, **kwargs)
    return rms_norm_ref(x, *args, **kwargs)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, *args, **kwargs):
    """In-place rotary embedding of ``q`` and ``k``; returns ``(q, k)``."""
    if q.is_cuda:
        return rotary_embedding_triton(positions, q, *args, **kwargs)
    return rotary_embedding_ref(positions, q, *args, **kwargs)


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
