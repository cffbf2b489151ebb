"""Kernel backends: the one dispatcher of the ops a decoder calls (paged attention, cache
write, RMSNorm, rotary embedding, fused mixture of experts), a small registry of classes
chosen by name and device.

- ``triton``: the Triton kernels (paged prefill with cached prefixes, decode, sliding window,
  soft cap, cache write, RMSNorm, rotary, fused MoE by expert tiles). CUDA tensors, or CPU
  tensors under ``TRITON_INTERPRET=1`` (correctness only: 30-500x slower than torch).
- ``native``: the torch twins, with the C kernels (``native.py``) where they take the
  tensors: decode attention, prefill attention over a cached prefix or chunk (plain
  prompts stay on SDPA's causal kernel), RMSNorm and rotary (each within the twin's
  stated numerics); mixture-of-experts grouped by expert, weights prepacked (``moe_ref``).
- ``torch``: the torch twins alone (SDPA prefill, batched padded decode): the reference.

The model picks one at load (``get_backend``); ``default_backend(device)`` is ``triton`` on
CUDA, ``native`` on CPU when the C kernels build, else ``torch``. ``<op>_ref`` (the twins, in
``*_ref.py``) and ``<op>_triton`` (the launchers, in ``*_triton.py``) stay callable on their
own; triton is imported only when a Triton op first runs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from abc import ABC, abstractmethod

import torch

from epdserve.kernels import native
from epdserve.kernels.attention_ref import paged_attention_ref
from epdserve.kernels.cache_ref import reshape_and_cache_ref
from epdserve.kernels.checks import check_reshape_and_cache, check_rms_norm, check_rotary
from epdserve.kernels.moe_ref import fused_moe_grouped, fused_moe_ref
from epdserve.kernels.norm_ref import rms_norm_ref
from epdserve.kernels.rotary_ref import rotary_embedding_ref

BACKEND_NAMES = ("triton", "native", "torch")


class KernelBackend(ABC):
    """The kernel ops of one decoder; stateless, shared by every layer."""

    name: str

    @abstractmethod
    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        step_cache: dict | None = None,
    ) -> torch.Tensor:
        """Causal paged attention over a mixed batch; returns a new ``out[T, H, D]``.

        Sequence ``i`` owns queries ``query_start_loc[i]:query_start_loc[i+1]``, the last
        ``q_len`` positions of its ``seq_lens[i]``-token context. Mutates nothing; cache
        layout, GQA, ``sliding_window`` and ``soft_cap`` as ``attention_ref`` says.
        ``step_cache`` (the step's ``AttentionMetadata.step_cache``, shared by every layer of
        one step) keeps what a kernel derives from the batch geometry alone, so the first
        layer derives it and the others reuse it; None derives it on every call."""

    @abstractmethod
    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write token ``t``'s K/V into cache slot ``slot_mapping[t]`` (-1 skipped).

        Mutates ``key_cache`` and ``value_cache`` in place."""

    @abstractmethod
    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ):
        """RMSNorm computed in fp32: ``out``, or with ``residual`` the pair
        ``(norm(x + residual), x + residual)``. Returns new tensors; mutates nothing."""

    @abstractmethod
    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of ``q [T, H, D]`` and ``k [T, KVH, D]`` at ``positions``.

        Mutates ``q`` and ``k`` in place and returns them."""

    @abstractmethod
    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Each token's routed SwiGLU experts, summed by their routing weights: a new
        ``[T, H]`` in ``x``'s dtype (``w13 [E, 2I, H]`` gate|up, ``w2 [E, H, I]``; semantics
        and numerics as ``moe_ref`` says). Mutates nothing."""


class TritonBackend(KernelBackend):
    name = "triton"

    def paged_attention(self, *args, **kwargs) -> torch.Tensor:
        from epdserve.kernels.attention_triton import paged_attention_triton

        return paged_attention_triton(*args, **kwargs)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        from epdserve.kernels.cache_triton import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)

    def rms_norm(self, x, weight, eps, residual=None):
        from epdserve.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        from epdserve.kernels.rotary_triton import rotary_embedding_triton

        return rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        from epdserve.kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)


class TorchBackend(KernelBackend):
    name = "torch"

    def paged_attention(self, *args, **kwargs) -> torch.Tensor:
        return paged_attention_ref(*args, **kwargs, native_decode=False)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)

    def rms_norm(self, x, weight, eps, residual=None):
        return rms_norm_ref(x, weight, eps, residual)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        return rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


class NativeBackend(TorchBackend):
    name = "native"

    def paged_attention(self, *args, **kwargs) -> torch.Tensor:
        return paged_attention_ref(*args, **kwargs)  # decode sequences: the C kernel

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        if native.cache_write_supports(key, value, key_cache, value_cache, slot_mapping):
            native.cache_write(key, value, key_cache, value_cache, slot_mapping)
        else:
            reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)

    def rms_norm(self, x, weight, eps, residual=None):
        check_rms_norm(x, weight, eps, residual)
        if native.rms_norm_supports(x, weight, residual):
            return native.rms_norm(x, weight, eps, residual)
        return rms_norm_ref(x, weight, eps, residual)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        check_rotary(positions, q, k, cos_sin_cache)
        if native.rotary_supports(positions, q, k, cos_sin_cache):
            return native.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
        return rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        return fused_moe_grouped(x, w13, w2, topk_weights, topk_ids)  # experts' packed weights


_CLASSES: dict[str, type[KernelBackend]] = {
    "triton": TritonBackend,
    "native": NativeBackend,
    "torch": TorchBackend,
}


def default_backend(device: torch.device | str) -> str:
    """``triton`` on CUDA; on CPU ``native`` when the C kernels build, else ``torch``."""
    if torch.device(device).type == "cuda":
        return "triton"
    return "native" if native.available() else "torch"


def check_backend(name: str | None, device: torch.device | str) -> str:
    """The backend a model on ``device`` will use for ``name`` (None: the default).

    Raises ``ValueError`` naming ``attention_backend`` when that backend cannot run there.
    """
    if name is None:
        return default_backend(device)
    if name not in _CLASSES:
        raise ValueError(
            f"attention_backend: must be one of {', '.join(BACKEND_NAMES)}, got {name!r}"
        )
    kind = torch.device(device).type
    if name == "triton":
        _check_triton(kind)
    elif name == "native":
        if kind != "cpu":
            raise ValueError(f"attention_backend: native runs on CPU only, device is {kind}")
        if not native.available():
            raise ValueError(
                "attention_backend: native needs the C decode kernel, which did not build "
                "(no C compiler, or EPDSERVE_NATIVE_KERNELS=0); use torch"
            )
    return name


def _check_triton(kind: str) -> None:
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention_backend: triton is not installed (pip install triton)")
    if kind == "cuda":
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend: triton on {kind} tensors needs TRITON_INTERPRET=1 in the "
            "environment before start (the interpreter; correctness only, very slow)"
        )
    # a kernel decorated before TRITON_INTERPRET was set stays compiled for the GPU
    mod = sys.modules.get("epdserve.kernels.attention_triton")
    if mod is not None and type(mod._paged_attention_kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            "attention_backend: triton kernels were imported before TRITON_INTERPRET=1 was "
            "set; set it before start"
        )


def get_backend(name: str | None, device: torch.device | str = "cpu") -> KernelBackend:
    """The backend called ``name`` (None: ``default_backend(device)``), checked for ``device``."""
    return _CLASSES[check_backend(name, device)]()
