"""Triton ``lora_apply`` (semantics and numerics: ``lora_ref.py``): shrink then expand.

Tokens are grouped by slot on the device (a stable sort; no host synchronisation): the
programs of slot ``s`` take its rows ``BLOCK_M`` at a time and return at once when the slot
has fewer rows. The shrink writes ``scaling[s] * x @ A[s].T`` for every adapter row into a
float32 ``[T, BLOCK_R]`` buffer; the expand adds ``round(h @ B[s].T)`` to ``y`` in
``BLOCK_N`` column tiles. Both products are float32 (``ieee``: no TF32), as in the twin.
Rows whose slot is -1 or outside ``0..S-1`` are left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epdserve.kernels.lora_ref import check_lora_apply


@triton.jit
def _rows_of_slot(order_ptr, starts_ptr, counts_ptr, s, m, BLOCK_M: tl.constexpr):
    count = tl.load(counts_ptr + s + 1)  # entry 0 counts the rows without an adapter
    start = tl.load(starts_ptr + s + 1)
    offs = m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(order_ptr + start + offs, mask=mask, other=0).to(tl.int64)
    return rows, mask, count


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, scaling_ptr, order_ptr, starts_ptr, counts_ptr,
    in_dim, rank, x_stride, a_ss, a_sr, a_sk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)
    s = tl.program_id(1)
    rows, mask_m, count = _rows_of_slot(order_ptr, starts_ptr, counts_ptr, s, m, BLOCK_M)
    if m * BLOCK_M >= count:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    a_base = a_ptr + s.to(tl.int64) * a_ss
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_dim
        xb = tl.load(x_ptr + rows[:, None] * x_stride + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        ab = tl.load(a_base + offs_r[None, :] * a_sr + offs_k[:, None] * a_sk,
                     mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(xb.to(tl.float32), ab.to(tl.float32), input_precision="ieee")
    acc = acc * tl.load(scaling_ptr + s)
    tl.store(h_ptr + rows[:, None] * BLOCK_R + offs_r[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])  # fmt: skip


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, counts_ptr,
    out_dim, rank, y_stride, b_ss, b_so, b_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.program_id(2)
    rows, mask_m, count = _rows_of_slot(order_ptr, starts_ptr, counts_ptr, s, m, BLOCK_M)
    if m * BLOCK_M >= count:
        return
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_dim
    hb = tl.load(h_ptr + rows[:, None] * BLOCK_R + offs_r[None, :],
                 mask=mask_m[:, None] & (offs_r < rank)[None, :], other=0.0)  # fmt: skip
    b_base = b_ptr + s.to(tl.int64) * b_ss
    bb = tl.load(b_base + offs_n[None, :] * b_so + offs_r[:, None] * b_sk,
                 mask=(offs_r < rank)[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
    d = tl.dot(hb, bb.to(tl.float32), input_precision="ieee")
    mask = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + rows[:, None] * y_stride + offs_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    d = d.to(y.dtype).to(tl.float32)  # the delta rounded to y's dtype, then one add
    tl.store(y_ptrs, (y.to(tl.float32) + d).to(y.dtype), mask=mask)


def lora_apply_triton(y, x, slots, a_stack, b_stack, scaling, *, checked: bool = False):
    """Triton launcher of ``lora_apply`` (``checked``: the caller already ran
    ``check_lora_apply``). Slot values are not read on the host."""
    if not checked:
        check_lora_apply(y, x, slots, a_stack, b_stack, scaling)
    tokens, in_dim = x.shape
    num_slots, rank, _ = a_stack.shape
    out_dim = y.shape[1]
    if tokens == 0 or num_slots == 0 or rank == 0 or out_dim == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    a, b, sc = a_stack, b_stack, scaling.contiguous()  # any strides for the stacks
    slot = slots.long()
    # key 0: no adapter (-1, or a slot outside the stack); key s + 1: slot s
    key = torch.where((slot >= 0) & (slot < num_slots), slot + 1, torch.zeros_like(slot))
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    block_r = max(16, triton.next_power_of_2(rank))
    block_m = 16
    block_k = max(16, min(64, triton.next_power_of_2(in_dim)))
    block_n = max(16, min(64, triton.next_power_of_2(out_dim)))
    h = torch.empty((tokens, block_r), dtype=torch.float32, device=x.device)
    grid_m = triton.cdiv(tokens, block_m)
    _lora_shrink_kernel[(grid_m, num_slots)](
        x, a, h, sc, order, starts, counts, in_dim, rank, x.stride(0), *a.stride(),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r,
    )  # fmt: skip
    _lora_expand_kernel[(grid_m, num_slots, triton.cdiv(out_dim, block_n))](
        h, b, y, order, starts, counts, out_dim, rank, y.stride(0), *b.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
