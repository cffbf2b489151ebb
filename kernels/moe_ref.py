"""The fused mixture-of-experts op: its checks, its torch twin, and the grouped CPU path.

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` runs each token's routed experts and sums
them by their routing weights: for token ``t`` and its ``j``-th expert ``e = topk_ids[t, j]``,
``y = w2[e] @ (silu(g) * u)`` with ``g | u = w13[e] @ x[t]`` (gate rows first, then up), and
``out[t] = sum_j topk_weights[t, j] * y``. ``w13`` is ``[E, 2I, H]``, ``w2`` ``[E, H, I]``.

Numerics (the twin): the two products in ``x``'s dtype, as ``F.linear``; the weighted sum in
float32, experts in increasing index order; ``out`` rounded to ``x``'s dtype once. An expert
that no token picked costs nothing. The grouped path (``fused_moe_grouped``, the native
backend) sorts the (token, expert) pairs by expert once and runs one product per expert on
its contiguous rows, with weights prepacked for oneDNN where bf16 (``kernels.linear``); its
sums are the twin's, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from epdserve.kernels.linear import linear


def check_fused_moe(x, w13, w2, topk_weights, topk_ids) -> None:
    """Shapes and dtypes of a ``fused_moe`` call (``ValueError`` naming the argument).
    ``w13`` / ``w2`` may be per-expert lists (the grouped path's packed weights)."""
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be [T, H], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe: topk_ids and topk_weights must both be [T, k], got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: {topk_ids.shape[0]} routed rows for {x.shape[0]} tokens")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if len(w13) != len(w2):
        raise ValueError(f"fused_moe: {len(w13)} gate/up experts but {len(w2)} down experts")
    if isinstance(w13, torch.Tensor):
        e, two_i, h = w13.shape
        if h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
            raise ValueError(
                f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                f"[E, 2I, H] and [E, H, I] with H={x.shape[1]}"
            )
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            raise ValueError(f"fused_moe: weights are {w13.dtype}/{w2.dtype}, x is {x.dtype}")


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The twin: expert by expert, each on the tokens that picked it. Returns a new
    ``[T, H]`` tensor in ``x``'s dtype; mutates nothing."""
    check_fused_moe(x, w13, w2, topk_weights, topk_ids)
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, j = torch.nonzero(topk_ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = F.linear(x[token], w13[e])
        y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e])
        out.index_add_(0, token, y.float() * topk_weights[token, j, None].float())
    return out.to(x.dtype)


def fused_moe_grouped(
    x: torch.Tensor,
    w13: torch.Tensor | Sequence[torch.Tensor],
    w2: torch.Tensor | Sequence[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The grouped path: one sort of the (token, expert) pairs, one gather of their rows,
    then per expert with tokens two products on a contiguous slice. ``w13[e]`` / ``w2[e]``
    may be packed matrices (``kernels.linear.pack``). Returns a new ``[T, H]`` tensor."""
    check_fused_moe(x, w13, w2, topk_weights, topk_ids)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, tokens ascending within
    counts = torch.bincount(flat, minlength=len(w13)).tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].float().unsqueeze(1)
    rows = x[tokens]
    ys = []  # each expert's outputs, in pair order: one weighted sum after the loop
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate_up = linear(rows[start : start + n], w13[e])
        inter = gate_up.shape[1] // 2
        ys.append(linear(F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]), w2[e]))
        start += n
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if ys:  # index_add_ adds the pairs in order: expert by expert, as the twin
        out.index_add_(0, tokens, torch.cat(ys).float().mul_(weights))
    return out.to(x.dtype)
