"""CPU kernels in C, built on first use and called via ctypes: decode attention
(``csrc/paged_decode.c``) and the small per-token ops (``csrc/cpu_ops.c``: rotary, RMSNorm).

The library is compiled with the system C compiler (``$CC``, else ``cc``) for this machine
(``-O3 -march=native``), with OpenMP when the compiler has it: the library then shares
torch's already-loaded ``libgomp.so.1`` and its thread count. It is cached under
``$EPDSERVE_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/epdserve/kernels``, else
``~/.cache/epdserve/kernels``, else a private directory in the temp dir), named by a hash of
the source, the flags, the compiler and the CPU, and written atomically, so concurrent
processes and machines sharing a home directory never load a foreign build. A directory
that is not ours or is writable by others is never loaded from.

When no compiler works, or ``EPDSERVE_NATIVE_KERNELS=0``, :func:`available` is False and
the torch twin's batched decode is used instead (same results up to rounding; it does not
reproduce the flash kernel's numerics).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("csrc") / "paged_decode.c",
           Path(__file__).with_name("csrc") / "cpu_ops.c")  # fmt: skip
BASE_FLAGS = [
    "-O3", "-march=native", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared",
    "-std=c11",
]  # fmt: skip

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_lanes = 0  # set on load

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [
    _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int, _I64, _I64, _I64,
    _PTR, _I64, _PTR, _PTR, ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int, ctypes.c_int,
]  # fmt: skip
_ROTARY_ARGTYPES = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, ctypes.c_int,
                    ctypes.c_int]  # fmt: skip
_RMS_NORM_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int,
                      ctypes.c_int]  # fmt: skip
# float32 lanes of torch's CPU kernels, which fix the flash kernel's exp/sum split
_LANES = {"AVX512": 16, "AVX2": 8}


def available() -> bool:
    """True when the native decode kernel is built (or could be built now) and loaded."""
    return _load() is not None


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _lanes
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("EPDSERVE_NATIVE_KERNELS", "1") not in ("0", "false", "no"):
                try:
                    _lib = _build_and_load()
                    _lanes = _LANES.get(torch.backends.cpu.get_cpu_capability(), 0)
                except (OSError, subprocess.SubprocessError) as exc:
                    logger.warning("native decode attention unavailable (%s); using torch", exc)
            _tried = True
    return _lib


def _build_and_load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        logger.warning("no C compiler found: CPU decode attention uses the torch twin")
        return None
    cache = _cache_dir()
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    errors = ""
    for flags in (BASE_FLAGS + ["-fopenmp"], BASE_FLAGS):
        key = hashlib.sha256(
            b"\0".join([source, " ".join(flags).encode(), _compiler_id(compiler), _cpu_id()])
        ).hexdigest()[:20]
        target = cache / f"paged_decode-{key}.so"
        if not target.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            cmd = [*shlex.split(compiler), *flags, "-o", tmp, *map(str, SOURCES), "-lm"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                os.unlink(tmp)
                errors = res.stderr[-500:]
                continue
            os.replace(tmp, target)
        lib = ctypes.CDLL(str(target))
        lib.epd_paged_decode.argtypes = _ARGTYPES
        lib.epd_paged_decode.restype = ctypes.c_int
        lib.epd_rotary.argtypes = _ROTARY_ARGTYPES
        lib.epd_rotary.restype = ctypes.c_int
        lib.epd_rms_norm.argtypes = _RMS_NORM_ARGTYPES
        lib.epd_rms_norm.restype = ctypes.c_int
        return lib
    logger.warning("%s could not build the CPU decode kernel; using torch: %s", compiler, errors)
    return None


def _compiler_id(compiler: str) -> bytes:
    res = subprocess.run([*shlex.split(compiler), "--version"], capture_output=True, timeout=30)
    return res.stdout[:200]


def _cpu_id() -> bytes:
    flags = b""
    try:
        for line in Path("/proc/cpuinfo").read_bytes().splitlines():
            if line.startswith((b"flags", b"Features")):
                flags = line
                break
    except OSError:
        pass
    return platform.machine().encode() + flags


def _cache_dir() -> Path:
    explicit = os.environ.get("EPDSERVE_KERNEL_CACHE")
    xdg = os.environ.get("XDG_CACHE_HOME")
    candidates = [Path(explicit)] if explicit else []
    candidates += [Path(xdg) / "epdserve" / "kernels"] if xdg else []
    candidates += [Path.home() / ".cache" / "epdserve" / "kernels"]
    candidates += [Path(tempfile.gettempdir()) / f"epdserve-kernels-{os.getuid()}"]
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = path.stat()
            if st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise OSError("no private writable directory for the kernel cache")


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
    if rc == -3:
        raise ValueError(f"block_table: a block id of the decoding sequences is outside "
                         f"0..{num_blocks - 1}")  # fmt: skip
    if rc == -2:
        raise MemoryError("paged_decode: no scratch memory")
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported layout (heads {num_heads}, kv heads "
                         f"{kv_heads})")  # fmt: skip
    return out.to(query.dtype)


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
