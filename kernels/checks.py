"""Argument validation shared by the torch twins and the Triton launchers.

Every check is shape/dtype metadata only (no device synchronisation), so the GPU path
pays nothing for it. Errors are ``ValueError`` naming the offending argument.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_float(name: str, t: torch.Tensor, ndim: int | None = None) -> None:
    """``t`` is a floating tensor of a supported dtype (and rank ``ndim`` when given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has unsupported dtype {t.dtype}; expected one of {FLOAT_DTYPES}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    """``t`` is an int32/int64 tensor of rank ``ndim``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from {ref_name} dtype {ref.dtype}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    """Every tensor in ``others`` lives on ``ref``'s device."""
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Paged caches ``[num_blocks, block_size, kv_heads, head_dim]`` with a contiguous last dim."""
    check_float("key_cache", key_cache, 4)
    check_float("value_cache", value_cache, 4)
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    check_same_dtype("value_cache", value_cache, "key_cache", key_cache)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (head_dim) dimension")


def check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Validate the arguments of ``reshape_and_cache``."""
    check_float("key", key, 3)
    check_float("value", value, 3)
    check_kv_cache(key_cache, value_cache)
    check_shape("value", value, tuple(key.shape))
    _, _, kv_heads, head_dim = key_cache.shape
    if tuple(key.shape[1:]) != (kv_heads, head_dim):
        raise ValueError(
            f"key must be [T, {kv_heads}, {head_dim}] to match key_cache, got {tuple(key.shape)}"
        )
    check_same_dtype("key", key, "key_cache", key_cache)
    check_same_dtype("value", value, "key_cache", key_cache)
    check_index("slot_mapping", slot_mapping, 1)
    check_same_device("key", key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping)  # fmt: skip
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens"
        )


def check_paged_attention(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, sliding_window, soft_cap
) -> None:
    """Validate the arguments of ``paged_attention`` (metadata only)."""
    check_float("query", query, 3)
    check_kv_cache(key_cache, value_cache)
    check_same_dtype("query", query, "key_cache", key_cache)
    _, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({kv_heads})")
    check_index("block_table", block_table, 2)
    check_index("seq_lens", seq_lens, 1)
    check_index("query_start_loc", query_start_loc, 1)
    check_same_device("query", query, key_cache=key_cache, value_cache=value_cache,
                      block_table=block_table, seq_lens=seq_lens,
                      query_start_loc=query_start_loc)  # fmt: skip
    num_seqs = seq_lens.shape[0]
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must have {num_seqs + 1} entries, got {query_start_loc.shape[0]}"
        )
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if soft_cap is not None and not float(soft_cap) > 0:
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap}")


def check_rms_norm(x, weight, eps, residual) -> None:
    """Validate the arguments of ``rms_norm``."""
    check_float("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    check_float("weight", weight, 1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} entries, x's last dim is {x.shape[-1]}")
    if not float(eps) >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if residual is not None:
        check_float("residual", residual)
        check_shape("residual", residual, tuple(x.shape))
        check_same_dtype("residual", residual, "x", x)


def check_rotary(positions, q, k, cos_sin_cache) -> None:
    """Validate the arguments of ``rotary_embedding``."""
    check_index("positions", positions, 1)
    check_float("q", q, 3)
    check_float("k", k, 3)
    check_float("cos_sin_cache", cos_sin_cache, 2)
    num_tokens, _, head_dim = q.shape
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries, q has {num_tokens} tokens")
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k must be [{num_tokens}, KVH, {head_dim}], got {tuple(k.shape)}")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim or rot_dim == 0:
        raise ValueError(f"cos_sin_cache rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
