"""The engine process keeps freed activations in its heap (glibc mallopt)."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from epdserve.engine import malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_tune_heap_keeps_freed_blocks_so_the_next_step_does_not_fault_them_in():
    """In fresh processes: a step-like pattern (16 blocks of 4 MiB allocated, written, freed;
    ten times) after one warm-up round. glibc's defaults give the freed heap back and the
    next round faults every page in again; after tune_heap the pages stay."""
    code = """
import ctypes, sys
from epdserve.engine.malloc import tune_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def minor_faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
def rounds(n):
    before = minor_faults()
    for _ in range(n):
        blocks = [libc.malloc(4 << 20) for _ in range(16)]
        for p in blocks:
            ctypes.memset(p, 1, 4 << 20)
        for p in blocks:
            libc.free(p)
    return minor_faults() - before
if sys.argv[1] == "tuned":
    assert tune_heap()
rounds(1)
print(rounds(10))
"""
    faults = {}
    for mode in ("default", "tuned"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                             check=True)  # fmt: skip
        faults[mode] = int(out.stdout.split()[-1])
    assert faults["default"] > 10 * 16 * 1024 // 2, faults  # most of 16k pages per round
    assert faults["tuned"] < 1000, faults


def test_without_mallopt_tune_heap_does_nothing(monkeypatch):
    def no_libc(*_args, **_kwargs):
        raise OSError("no libc")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert malloc.tune_heap() is False
