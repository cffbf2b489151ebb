"""``lora_apply``: the chooser over the LoRA kernels (torch twin, C kernel, Triton).

``y[t] += scaling[s] * (x[t] @ A[s].T) @ B[s].T`` in place for each token ``t`` whose
adapter slot ``s = slots[t]`` is not -1 (shapes and numerics: ``lora_ref.py``).

- CUDA: the Triton kernel (``lora_triton.py``).
- CPU, bfloat16 or float32 activations: the C kernel (``csrc/lora.c``), one call for the
  whole batch whatever its mix of slots (at decode sizes a chain of torch ops per adapter
  costs more in dispatch than in arithmetic: ``bench/lora_kernels.py``).
- Otherwise (float16 on CPU, no C compiler, ``EPDSERVE_NATIVE_KERNELS=0``): the torch twin.

The stacks may have any strides: ``b_stack`` as a transposed view of ``[S, r, out]`` memory
(the expand's natural layout) is read in place on both paths; contiguous ``[S, out, r]`` is
as fast on CPUs (B is transposed in tiles, or read by rows for a slot with a few tokens).
"""

from __future__ import annotations

import torch

from epdserve.kernels import native
from epdserve.kernels.lora_ref import check_lora_apply, check_slot_range, lora_apply_ref

_CPU_DTYPES = (torch.bfloat16, torch.float32)


def lora_apply(y, x, slots, a_stack, b_stack, scaling) -> None:
    """Add each token's adapter delta to ``y`` in place; ``ValueError`` on bad arguments.

    ``x [T, in]``, ``y [T, out]`` (same dtype; may be a column-slice view), ``slots``
    int32 ``[T]`` (-1 = no adapter), ``a_stack [S, r, in]``, ``b_stack [S, out, r]``
    (float32 or ``x``'s dtype; zero-padded to the largest rank), ``scaling`` float32 ``[S]``.
    On CPUs a slot outside ``-1..S-1`` is a ``ValueError`` (nothing written); on CUDA the
    slots are not read on the host (no synchronisation) and such rows are left untouched.
    """
    check_lora_apply(y, x, slots, a_stack, b_stack, scaling)
    if y.device.type == "cuda":
        from epdserve.kernels.lora_triton import lora_apply_triton

        lora_apply_triton(y, x, slots, a_stack, b_stack, scaling, checked=True)
    elif y.device.type == "cpu" and y.dtype in _CPU_DTYPES and native.available():
        lora_apply_native(y, x, slots, a_stack, b_stack, scaling)
    else:
        check_slot_range(slots, a_stack.shape[0])
        lora_apply_ref(y, x, slots, a_stack, b_stack, scaling)


def lora_apply_native(y, x, slots, a_stack, b_stack, scaling, *, lib=None) -> None:
    """The C kernel on CPU tensors already validated by :func:`check_lora_apply` (bfloat16
    or float32 activations); checks the slot values itself. ``lib``: another build of the
    library (tests), else the loaded one."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if slots.dtype != torch.int32 or not slots.is_contiguous():
        slots = slots.to(torch.int32).contiguous()
    a, sc = a_stack.contiguous(), scaling.contiguous()
    num_slots, rank, in_dim = a.shape
    b = b_stack  # any strides: a transposed view of [S, r, out] memory is read in place
    bf16, w_bf16 = int(y.dtype == torch.bfloat16), int(a.dtype == torch.bfloat16)
    rc = (lib or native._load()).epd_lora_apply(
        y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), slots.data_ptr(), x.shape[0],
        a.data_ptr(), b.data_ptr(), *b.stride(), sc.data_ptr(), num_slots, rank, in_dim,
        y.shape[1], bf16, w_bf16, torch.get_num_threads(),
    )  # fmt: skip
    if rc == -1:
        check_slot_range(slots, num_slots)  # raises, naming the range
    if rc != 0:
        raise MemoryError(f"lora_apply: the C kernel failed ({rc})")
