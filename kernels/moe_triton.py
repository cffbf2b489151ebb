"""Triton ``fused_moe`` (semantics: ``moe_ref.py``): tokens sorted by expert into tiles.

The ``T * k`` (token, expert) pairs are sorted by expert on the device (no host
synchronisation) and each expert's run is padded to a multiple of ``BLOCK_M``, so every tile
of ``BLOCK_M`` sorted pairs belongs to one expert: ``pairs[i]`` is the pair at sorted place
``i`` (``T * k`` for padding) and ``tile_expert[m]`` the expert of tile ``m`` (-1 past the
last tile; the grid is sized for the worst case, ``ceil(T * k / BLOCK_M) + E`` tiles). One
program per (tile, column block) then runs the expert's product on the tile's rows:

- gate/up: ``h[pair] = silu(x[token] @ gate.T) * (x[token] @ up.T)``, both products
  accumulated in float32 and the activation taken before one rounding to ``x``'s dtype;
- down: ``y[pair] = topk_weight[pair] * (h[pair] @ w2[e].T)`` in float32;

and the ``k`` rows of each token are summed on the host side (``y.view(T, k, H).sum(1)``),
so no two programs write one row. float32 inputs use IEEE products (no TF32); fp16/bf16 use
the native ``tl.dot`` on GPU, and float32 products under ``TRITON_INTERPRET=1`` (which
cannot do bf16 arithmetic).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from epdserve.kernels.moe_ref import check_fused_moe


@triton.jit
def _tile_rows(pairs_ptr, tile_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pair, pair < num_pairs


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, pairs_ptr, tile_expert_ptr,
    num_pairs, top_k, hidden, inter, x_stride, w_se, w_sn, w_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    expert, pair, mask_m = _tile_rows(pairs_ptr, tile_expert_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    token = (pair // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    w_base = w_ptr + expert.to(tl.int64) * w_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        xb = tl.load(x_ptr + token[:, None] * x_stride + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        w_mask = mask_k[:, None] & mask_n[None, :]
        gb = tl.load(w_base + offs_n[None, :] * w_sn + offs_k[:, None] * w_sk,
                     mask=w_mask, other=0.0)  # fmt: skip
        ub = tl.load(w_base + (offs_n[None, :] + inter) * w_sn + offs_k[:, None] * w_sk,
                     mask=w_mask, other=0.0)  # fmt: skip
        if IEEE:
            xb = xb.to(tl.float32)
            acc_g += tl.dot(xb, gb.to(tl.float32), input_precision="ieee")
            acc_u += tl.dot(xb, ub.to(tl.float32), input_precision="ieee")
        else:
            acc_g += tl.dot(xb, gb)
            acc_u += tl.dot(xb, ub)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + pair[:, None].to(tl.int64) * inter + offs_n[None, :],
             h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, weights_ptr, pairs_ptr, tile_expert_ptr,
    num_pairs, hidden, inter, w_se, w_sn, w_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    expert, pair, mask_m = _tile_rows(pairs_ptr, tile_expert_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    row = pair.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    w_base = w_ptr + expert.to(tl.int64) * w_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < inter
        hb = tl.load(h_ptr + row[:, None] * inter + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        wb = tl.load(w_base + offs_n[None, :] * w_sn + offs_k[:, None] * w_sk,
                     mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        if IEEE:
            acc += tl.dot(hb.to(tl.float32), wb.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(hb, wb)
    acc = acc * tl.load(weights_ptr + row, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + row[:, None] * hidden + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """``(pairs, tile_expert)``: the (token, expert) pairs sorted by expert, each expert's
    run padded to ``block_m`` with ``T * k``, and each tile's expert (-1: no tile). On the
    device, without reading counts on the host."""
    flat = topk_ids.reshape(-1).long()
    num_pairs, device = flat.numel(), flat.device
    max_tiles = -(-num_pairs // block_m) + num_experts
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount reads its max on the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in ``order``
    place = torch.arange(num_pairs, device=device) - first[by_expert]
    dest = (padded_end - padded)[by_expert] + place
    pairs = torch.full((max_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    pairs[dest] = order.to(torch.int32)
    tile_start = torch.arange(max_tiles, device=device) * block_m
    expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return pairs, tile_expert


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Triton launcher of ``fused_moe``: returns a new ``[T, H]`` in ``x``'s dtype."""
    check_fused_moe(x, w13, w2, topk_weights, topk_ids)
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    block_m = 16  # tl.dot needs >= 16 rows; decode tiles are mostly padding at any size
    pairs, tile_expert = sort_pairs_by_expert(topk_ids, num_experts, block_m)
    num_pairs, grid_m = tokens * top_k, tile_expert.numel()
    ieee = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    block_k = max(16, min(64, triton.next_power_of_2(hidden)))
    block_n = max(16, min(64, triton.next_power_of_2(inter)))
    _gate_up_kernel[(grid_m, triton.cdiv(inter, block_n))](
        x, w13, h, pairs, tile_expert, num_pairs, top_k, hidden, inter, x.stride(0),
        *w13.stride(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    y = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    block_k = max(16, min(64, triton.next_power_of_2(inter)))
    block_n = max(16, min(64, triton.next_power_of_2(hidden)))
    _down_kernel[(grid_m, triton.cdiv(hidden, block_n))](
        h, w2, y, weights, pairs, tile_expert, num_pairs, hidden, inter, *w2.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    return y.view(tokens, top_k, hidden).sum(1).to(x.dtype)
