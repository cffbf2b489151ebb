"""Building and loading the C kernels of ``native.py``: compile once per source, flags,
compiler and CPU, cache the library in a private directory, bind the entry points.

The library is compiled with the system C compiler (``$CC``, else ``cc``) for this machine
(``-O3 -march=native``), with OpenMP when the compiler has it: the library then shares
torch's already-loaded ``libgomp.so.1`` and its thread count. It is cached under
``$EPDSERVE_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/epdserve/kernels``, else
``~/.cache/epdserve/kernels``, else a private directory in the temp dir), named by a hash of
the sources and headers, the flags, the compiler and the CPU, and written atomically, so
concurrent processes and machines sharing a home directory never load a foreign build. A
directory that is not ours or is writable by others is never loaded from.
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
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_decode.c", CSRC / "paged_prefill.c", CSRC / "cpu_ops.c", CSRC / "lora.c",
           CSRC / "fp8_kv.c")  # fmt: skip
HEADERS = (CSRC / "cpu_simd.h", CSRC / "lora_simd.h")
BASE_FLAGS = [
    "-O3", "-march=native", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared",
    "-std=c11",
]  # fmt: skip

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_INT = ctypes.c_int
_F32 = ctypes.c_float
ARGTYPES = {
    "epd_paged_decode": [
        _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _INT, _I64, _I64, _I64,
        _PTR, _I64, _PTR, _PTR, _F32, _I64, _F32, _INT, _INT,
    ],
    "epd_paged_prefill": [
        _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _INT, _I64, _I64, _I64, _PTR,
        _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _F32, _I64, _F32, _INT, _INT,
    ],
    "epd_rotary": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _INT, _INT],
    "epd_rms_norm": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT, _INT],
    "epd_cache_write": [
        _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64
    ],
    "epd_fp8_blocks": [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "epd_lora_apply": [
        _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64,
        _I64, _INT, _INT, _INT,
    ],
}  # fmt: skip


def build_and_load() -> ctypes.CDLL | None:
    """The library with every entry point bound; None without a C compiler that builds it.

    Raises ``OSError``/``SubprocessError`` when the cache or the compiler fails outright."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        logger.warning("no C compiler found: CPU attention uses the torch twin")
        return None
    cache = _cache_dir()
    source = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
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
        for name, argtypes in ARGTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        return lib
    logger.warning("%s could not build the CPU kernels; using torch: %s", compiler, errors)
    return None


def _compiler_id(compiler: str) -> bytes:
    res = subprocess.run([*shlex.split(compiler), "--version"], capture_output=True, timeout=30)
    return res.stdout[:200]


def _cpu_flags_line() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_bytes().splitlines():
            if line.startswith((b"flags", b"Features")):
                return line
    except OSError:
        pass
    return b""


def _cpu_id() -> bytes:
    return platform.machine().encode() + _cpu_flags_line()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none): which of
    ``amx_bf16``, ``avx512_bf16`` the matrix products and kernels can use."""
    _, _, names = _cpu_flags_line().decode(errors="replace").partition(":")
    return frozenset(names.split())


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
