"""Kernel tests: run Triton in interpreter mode on CPU tensors.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated, i.e. when
``epdserve.kernels.*_triton`` modules are first imported (lazily, by the launchers). Setting it
here, before any kernel test runs, is enough as long as no earlier test imported those
modules; the ``interpreted`` fixture fails loudly if one did.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).parent))  # kernels_testlib

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def interpreted():
    """Skip without triton; fail if the kernels were decorated outside interpreter mode."""
    pytest.importorskip("triton")
    from epdserve.kernels import attention_triton

    kind = type(attention_triton._paged_attention_kernel).__name__
    if kind != "InterpretedFunction":
        pytest.fail(f"Triton kernels were imported before TRITON_INTERPRET=1 was set ({kind})")
