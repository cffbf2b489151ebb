"""Attention backends: the paged-attention and cache-write ops the decoder calls, by name.

- ``triton``: the Triton kernels (paged prefill with cached prefixes, decode, sliding window,
  soft cap, cache write). CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``
  (correctness only: 30-500x slower than torch).
- ``native``: the torch twin whose decode sequences run the C kernel (``native.py``).
- ``torch``: the torch twin alone (SDPA prefill, batched padded decode).

The model picks one at load (``get_backend``); ``default_backend(device)`` is ``triton`` on
CUDA, ``native`` on CPU when the C kernel builds, else ``torch``. RMSNorm and rotary stay on
the device dispatch of ``epdserve.kernels.api``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from abc import ABC, abstractmethod

import torch

from epdserve.kernels import api, native
from epdserve.kernels.attention_ref import paged_attention_ref
from epdserve.kernels.cache_ref import reshape_and_cache_ref

BACKEND_NAMES = ("triton", "native", "torch")


class AttentionBackend(ABC):
    """The attention ops of one decoder layer; stateless, shared by every layer."""

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
    ) -> torch.Tensor:
        """Causal paged attention over a mixed batch; returns a new ``out[T, H, D]``.

        Mutates nothing; semantics are ``attention_ref.paged_attention_ref``'s."""

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


class TritonBackend(AttentionBackend):
    name = "triton"

    def paged_attention(self, *args, **kwargs) -> torch.Tensor:
        return api.paged_attention_triton(*args, **kwargs)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        api.reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)


class NativeBackend(AttentionBackend):
    name = "native"

    def paged_attention(self, *args, **kwargs) -> torch.Tensor:
        return paged_attention_ref(*args, **kwargs)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)


class TorchBackend(NativeBackend):
    name = "torch"

    def paged_attention(self, *args, **kwargs) -> torch.Tensor:
        return paged_attention_ref(*args, **kwargs, native_decode=False)


_CLASSES: dict[str, type[AttentionBackend]] = {
    "triton": TritonBackend,
    "native": NativeBackend,
    "torch": TorchBackend,
}


def default_backend(device: torch.device | str) -> str:
    """``triton`` on CUDA; on CPU ``native`` when the C decode kernel builds, else ``torch``."""
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


def get_backend(name: str | None, device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called ``name`` (None: ``default_backend(device)``), checked for ``device``."""
    return _CLASSES[check_backend(name, device)]()
