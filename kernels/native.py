"""CPU kernels in C, built on first use and called via ctypes: paged attention for decode
(``csrc/paged_decode.c``) and for prefill spans over a cached prefix (``csrc/paged_prefill.c``),
the small per-token ops (``csrc/cpu_ops.c``: rotary, RMSNorm, the KV-cache write), and the
read-back of an fp8 KV cache (``csrc/fp8_kv.c``).

How the library is built, cached and bound: ``native_build.py``. When no compiler works, or
``EPDSERVE_NATIVE_KERNELS=0``, :func:`available` is False and the torch twins are used
instead (same results up to rounding; they do not reproduce the flash kernel's numerics).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import threading

import torch

from epdserve.kernels import native_build

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_lanes = 0  # set on load
# float32 lanes of torch's CPU kernels, which fix the flash kernel's exp/sum split
_LANES = {"AVX512": 16, "AVX2": 8}


def available() -> bool:
    """True when the native kernels are built (or could be built now) and loaded."""
    return _load() is not None


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _lanes
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("EPDSERVE_NATIVE_KERNELS", "1") not in ("0", "false", "no"):
                try:
                    _lib = native_build.build_and_load()
                    _lanes = _LANES.get(torch.backends.cpu.get_cpu_capability(), 0)
                except (OSError, subprocess.SubprocessError) as exc:
                    logger.warning("native CPU kernels unavailable (%s); using torch", exc)
            _tried = True
    return _lib


def paged_decode(query, key_cache, value_cache, block_table, rows, lens, scale: float,
                 window: int | None, soft_cap: float | None) -> torch.Tensor:  # fmt: skip
    """Decode attention of ``query [S, H, D]`` (one token per sequence) in the query's dtype.

    Sequence ``i`` reads table row ``rows[i]`` (``i`` when ``rows`` is None) and attends to
    its ``lens[i]`` keys. Caches are ``[N, BS, KVH, D]`` views with equal strides and a
    contiguous last dim, both bfloat16 or both float32 (:func:`supports`). bfloat16 follows
    torch's flash kernel numerics for this CPU (``csrc/paged_decode.c``).
    """
    lib = _load()
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, _ = key_cache.shape
    q = query.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    table = block_table if block_table.dtype == torch.int32 else block_table.int()
    table = table if table.stride(1) == 1 else table.contiguous()
    lens_t = torch.as_tensor(lens, dtype=torch.int32)
    rows_t = None if rows is None else torch.as_tensor(rows, dtype=torch.int32)
    bf16 = key_cache.dtype == torch.bfloat16
    lanes = _lanes if bf16 else 0
    s_n, s_b, s_h, _ = key_cache.stride()
    rc = lib.epd_paged_decode(
        q.data_ptr(), out.data_ptr(), num_seqs, num_heads, head_dim,
        key_cache.data_ptr(), value_cache.data_ptr(), s_n, s_b, s_h, int(bf16), block_size,
        kv_heads, num_blocks, table.data_ptr(), table.stride(0),
        None if rows_t is None else rows_t.data_ptr(), lens_t.data_ptr(), float(scale),
        int(window or 0), float(soft_cap or 0.0), lanes, torch.get_num_threads(),
    )  # fmt: skip
    _check_rc(rc, "paged_decode", "decoding", num_blocks,
              f"unsupported layout (heads {num_heads}, kv heads {kv_heads})")  # fmt: skip
    return out.to(query.dtype)


def _check_rc(rc: int, kernel: str, seqs: str, num_blocks: int, layout: str) -> None:
    """Raise for an attention kernel's error code: -3 a bad block id, -2 no scratch, other
    non-zero ``layout``."""
    if rc == -3:
        raise ValueError(f"block_table: a block id of the {seqs} sequences is outside "
                         f"0..{num_blocks - 1}")  # fmt: skip
    if rc == -2:
        raise MemoryError(f"{kernel}: no scratch memory")
    if rc != 0:
        raise ValueError(f"{kernel}: {layout}")


def supports(query, key_cache, value_cache) -> bool:
    """Whether :func:`paged_decode` takes these tensors (else use the torch twin)."""
    return (
        query.device.type == "cpu"
        and key_cache.dtype in (torch.bfloat16, torch.float32)
        and value_cache.dtype == key_cache.dtype
        and key_cache.stride() == value_cache.stride()
        and key_cache.stride(3) == 1
        and available()
    )


def paged_prefill(query, key_cache, value_cache, block_table, seqs, starts, q_lens, lens,
                  scale: float, window: int | None, soft_cap: float | None, *,
                  bf16_pairs: bool = True) -> torch.Tensor:  # fmt: skip
    """Causal attention of the query spans of sequences ``seqs`` in one call; float32 out.

    Sequence ``seqs[j]`` (its table row) owns queries ``starts[j] .. starts[j] + q_lens[j]``
    of ``query [T, H, D]``, the last ``q_lens[j]`` positions of its ``lens[j]``-token
    context. Returns ``[T, H, D]`` float32 with those rows filled and the others 0 (the
    caller rounds to the query's dtype). Caches as :func:`paged_decode` takes them
    (:func:`prefill_supports`); numerics in ``csrc/paged_prefill.c``. ``bf16_pairs=False``
    converts bfloat16 tiles to float32 even where the CPU has bfloat16 dot products (tests).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, _ = key_cache.shape
    q = query.to(torch.float32).contiguous()
    covered = sum(q_lens) == num_tokens  # every row is in a span: no row left to clear
    out = torch.empty_like(q) if covered else torch.zeros_like(q)
    table = block_table if block_table.dtype == torch.int32 else block_table.int()
    table = table if table.stride(1) == 1 else table.contiguous()
    ints = [torch.as_tensor(x, dtype=torch.int32) for x in (seqs, starts, q_lens, lens)]
    s_n, s_b, s_h, _ = key_cache.stride()
    kind = (2 - bf16_pairs) if key_cache.dtype == torch.bfloat16 else 0  # 1 pairs, 2 float32
    rc = _load().epd_paged_prefill(
        q.data_ptr(), out.data_ptr(), num_heads, head_dim, key_cache.data_ptr(),
        value_cache.data_ptr(), s_n, s_b, s_h, kind, block_size, kv_heads, num_blocks,
        table.data_ptr(), table.stride(0), table.shape[1], len(seqs),
        *(t.data_ptr() for t in ints), float(scale), int(window or 0), float(soft_cap or 0.0), _lanes if kind else 0, torch.get_num_threads(),
    )  # fmt: skip
    _check_rc(rc, "paged_prefill", "prefill", num_blocks,
              f"unsupported layout or lengths (heads {num_heads}, kv heads {kv_heads}, "
              f"head_dim {head_dim})")  # fmt: skip
    return out


def prefill_supports(query, key_cache, value_cache) -> bool:
    """Whether :func:`paged_prefill` takes these tensors (else use the torch twin)."""
    return query.shape[2] % 16 == 0 and supports(query, key_cache, value_cache)


def rotary_supports(positions, q, k, cos_sin_cache) -> bool:
    """Whether :func:`rotary_embedding` takes these tensors (else use the torch twin)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float32)
        and k.dtype == q.dtype == cos_sin_cache.dtype
        and positions.dtype == torch.int64
        and q.is_contiguous()
        and k.is_contiguous()
        and cos_sin_cache.is_contiguous()
        and positions.is_contiguous()
        and available()
    )


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox: bool):
    """``rotary_ref.rotary_embedding_ref`` in one pass (same rounding), in place on ``q``
    and ``k``; arguments already checked and :func:`rotary_supports`. Returns ``(q, k)``."""
    num_tokens, heads, head_dim = q.shape
    max_pos, rot_dim = cos_sin_cache.shape
    rc = _load().epd_rotary(
        positions.data_ptr(), q.data_ptr(), k.data_ptr(), num_tokens, heads, k.shape[1],
        head_dim, cos_sin_cache.data_ptr(), max_pos, rot_dim, int(is_neox),
        int(q.dtype == torch.bfloat16),
    )  # fmt: skip
    if rc != 0:
        raise IndexError(f"positions: a position is outside 0..{max_pos - 1}")
    return q, k


_NORM_DTYPES = (torch.bfloat16, torch.float32)
_X86_SUM = platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX512", "AVX2")  # fmt: skip


def rms_norm_supports(x, weight, residual) -> bool:
    """Whether :func:`rms_norm` takes these tensors (else use the torch twin)."""
    return (
        x.device.type == "cpu"
        and x.dtype in _NORM_DTYPES
        and weight.dtype in _NORM_DTYPES
        and x.is_contiguous()
        and weight.is_contiguous()
        and (residual is None or residual.is_contiguous())
        and _X86_SUM  # the mean is summed in the order of torch's x86 sum kernel
        and available()
    )


def rms_norm(x, weight, eps: float, residual=None):
    """``norm_ref.rms_norm_ref`` in one pass per row (same rounding, the mean summed in the
    order of torch's x86 sum kernel); arguments already checked and :func:`rms_norm_supports`.
    Returns new tensors: ``out``, or ``(out, x + residual)``."""
    n = x.shape[-1]  # check_rms_norm: x has at least one dim
    tokens = x.numel() // max(n, 1)
    out = torch.empty_like(x)
    res_out = None if residual is None else torch.empty_like(x)
    rc = _load().epd_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), None if res_out is None else res_out.data_ptr(), tokens, n, float(eps),
        int(x.dtype == torch.bfloat16), int(weight.dtype == torch.bfloat16),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("rms_norm: no scratch memory")
    return out if residual is None else (out, res_out)


def cache_write_supports(key, value, key_cache, value_cache, slot_mapping) -> bool:
    """Whether :func:`cache_write` takes these tensors (else use the torch twin): rows of
    ``key``/``value`` and each cache block's rows contiguous, slots int64 or int32."""
    return (
        key.device.type == "cpu"
        and key.dtype in (torch.bfloat16, torch.float32)
        and all(t.dtype == key.dtype for t in (value, key_cache, value_cache))
        and _rows_contiguous(key, 1)
        and _rows_contiguous(value, 1)
        and _rows_contiguous(key_cache, 2)
        and _rows_contiguous(value_cache, 2)
        and slot_mapping.dtype in (torch.int64, torch.int32)
        and available()
    )


def _rows_contiguous(t: torch.Tensor, first: int) -> bool:
    """Dims ``first``.. of ``t`` are laid out as one contiguous run."""
    expected = 1
    for size, stride in zip(reversed(t.shape[first:]), reversed(t.stride()[first:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def cache_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    """``cache_ref.reshape_and_cache_ref`` as one memcpy per row, on one thread; arguments
    already checked and :func:`cache_write_supports`."""
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    slots = slot_mapping.to(torch.int64).contiguous()
    rc = _load().epd_cache_write(
        key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), key_cache.data_ptr(),
        value_cache.data_ptr(), key_cache.stride(0), value_cache.stride(0), slots.data_ptr(),
        key.shape[0], kv_heads * head_dim, block_size, num_blocks, key.element_size(),
    )  # fmt: skip
    if rc != 0:
        raise IndexError(f"slot_mapping: a slot is outside 0..{num_blocks * block_size - 1}")


_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}


def fp8_blocks_supports(cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`fp8_blocks` reads ``cache [N, ...]`` (fp8, each block one contiguous
    run, on the CPU) into ``dtype`` (bfloat16 or float32)."""
    return (
        cache.device.type == "cpu"
        and cache.dtype == torch.float8_e4m3fn
        and dtype in (torch.bfloat16, torch.float32)
        and _rows_contiguous(cache, 1)
        and available()
    )


def fp8_blocks(cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cache.index_select(0, ids).to(dtype)`` in one pass (``csrc/fp8_kv.c``), the same
    bits; where :func:`fp8_blocks_supports`."""
    if dtype not in _FP8_TABLES:  # every fp8 byte's value, as torch casts it
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        _FP8_TABLES[dtype] = every.to(dtype).contiguous()
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), *cache.shape[1:]), dtype=dtype)
    per_block = cache[0].numel()
    rc = _load().epd_fp8_blocks(
        cache.data_ptr(), cache.stride(0), ids.data_ptr(), ids.numel(), per_block,
        cache.shape[0], _FP8_TABLES[dtype].data_ptr(), out.data_ptr(), out.element_size(),
    )  # fmt: skip
    if rc != 0:
        raise IndexError(f"ids: a block is outside 0..{cache.shape[0] - 1}")
    return out
