"""Torch twin of ``lora_apply``: many LoRA adapters over one projection, one slot per token.

Every other path (the C kernel on CPUs, Triton on GPUs; ``lora.py`` chooses) is checked
against :func:`lora_apply_ref`. The twin's numerics are the contract::

    h = (x[t].float() @ A[s].float().T) * scaling[s]      # shrink, fp32, [r]
    d = h @ B[s].float().T                                # expand, fp32, [out]
    y[t] = y[t] + d.to(y.dtype)                           # one add in y's dtype

for each token ``t`` whose slot ``s = slots[t]`` is not -1; rows with slot -1 are untouched.
"""

from __future__ import annotations

import torch

from epdserve.kernels.checks import (
    check_float,
    check_index,
    check_same_device,
    check_same_dtype,
    check_shape,
)


def check_lora_apply(y, x, slots, a_stack, b_stack, scaling) -> None:
    """Validate the arguments of ``lora_apply`` (shapes, dtypes, devices: metadata only).

    ``x [T, in]``, ``y [T, out]`` of one dtype, ``y`` with a contiguous last dim (a
    column-slice view of a wider tensor is fine); ``slots`` int32/int64 ``[T]``;
    ``a_stack [S, r, in]`` and ``b_stack [S, out, r]`` of one dtype, float32 or ``x``'s;
    ``scaling`` float32 ``[S]``. The slot values are checked by :func:`check_slot_range`.
    """
    if _well_formed(y, x, slots, a_stack, b_stack, scaling):
        return  # the common case in one expression (called per projection and step)
    check_float("x", x, 2)
    check_float("y", y, 2)
    check_same_dtype("y", y, "x", x)
    check_index("slots", slots, 1)
    check_float("a_stack", a_stack, 3)
    check_float("b_stack", b_stack, 3)
    check_same_dtype("b_stack", b_stack, "a_stack", a_stack)
    if a_stack.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"a_stack dtype {a_stack.dtype} must be float32 or x's dtype {x.dtype}")
    if not isinstance(scaling, torch.Tensor) or scaling.dtype != torch.float32:
        raise ValueError(
            f"scaling must be a float32 tensor, got {getattr(scaling, 'dtype', scaling)}"
        )
    tokens, in_dim = x.shape
    num_slots, rank, _ = a_stack.shape
    out_dim = y.shape[1]
    if y.shape[0] != tokens or slots.shape[0] != tokens:
        raise ValueError(
            f"x, y and slots must have the same number of tokens, got x {tuple(x.shape)}, "
            f"y {tuple(y.shape)}, slots {tuple(slots.shape)}"
        )
    check_shape("a_stack", a_stack, (num_slots, rank, in_dim))
    check_shape("b_stack", b_stack, (num_slots, out_dim, rank))
    check_shape("scaling", scaling, (num_slots,))
    if y.stride(1) != 1 and out_dim > 1:
        raise ValueError("y must have a contiguous last dimension (a column slice is fine)")
    check_same_device("x", x, y=y, slots=slots, a_stack=a_stack, b_stack=b_stack, scaling=scaling)


_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
_SLOTS = (torch.int32, torch.int64)


def _well_formed(y, x, slots, a_stack, b_stack, scaling) -> bool:
    """True when every check of :func:`check_lora_apply` passes (False: look closer)."""
    try:
        (tokens, in_dim), (y_tokens, out_dim) = x.shape, y.shape
        num_slots, rank, a_in = a_stack.shape
        dtype, wdtype, device = x.dtype, a_stack.dtype, x.device
        return (
            dtype in _ACTIVATIONS
            and y.dtype == dtype
            and wdtype in (torch.float32, dtype)
            and b_stack.dtype == wdtype
            and scaling.dtype == torch.float32
            and slots.dtype in _SLOTS
            and a_in == in_dim
            and y_tokens == tokens
            and slots.shape == (tokens,)
            and b_stack.shape == (num_slots, out_dim, rank)
            and scaling.shape == (num_slots,)
            and (y.stride(1) == 1 or out_dim <= 1)
            and y.device == device
            and slots.device == device
            and a_stack.device == device
            and b_stack.device == device
            and scaling.device == device
        )
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
        return False


def check_slot_range(slots: torch.Tensor, num_slots: int) -> None:
    """Every slot is -1 (no adapter) or in ``0..num_slots-1``; reads the values (a device
    synchronisation on GPUs)."""
    if slots.numel() == 0:
        return
    lo, hi = torch.aminmax(slots)
    lo, hi = int(lo), int(hi)
    if lo < -1 or hi >= num_slots:
        raise ValueError(
            f"slots must be -1 (no adapter) or in 0..{num_slots - 1}, got values in {lo}..{hi}"
        )


def lora_apply_ref(y, x, slots, a_stack, b_stack, scaling) -> None:
    """``y[t] += scaling[s] * (x[t] @ A[s].T) @ B[s].T`` for each token ``t`` with slot
    ``s = slots[t] >= 0``, in place (numerics in the module docstring)."""
    check_lora_apply(y, x, slots, a_stack, b_stack, scaling)
    check_slot_range(slots, a_stack.shape[0])
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        h = (x[rows].float() @ a_stack[s].float().T) * scaling[s]
        d = h @ b_stack[s].float().T
        y[rows] = y[rows] + d.to(y.dtype)
