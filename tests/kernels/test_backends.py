"""The backend registry: every backend offers the four ops, the CPU ones agree with the
torch twins, and each works inside and outside inference mode."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kernels_testlib import cpu_backend, make_batch

from epdserve.kernels import BACKEND_NAMES, KernelBackend, paged_attention_ref
from epdserve.kernels.backends import _CLASSES

OPS = ("paged_attention", "reshape_and_cache", "rms_norm", "rotary_embedding")


def test_every_registered_backend_implements_every_op():
    assert set(_CLASSES) == set(BACKEND_NAMES)
    for cls in _CLASSES.values():
        assert issubclass(cls, KernelBackend) and not cls.__abstractmethods__
        assert all(callable(getattr(cls, op)) for op in OPS)


@pytest.mark.parametrize("name", ["native", "torch"])
def test_paged_attention_is_the_same_inside_and_outside_inference_mode(name):
    backend = cpu_backend(name)
    q, kc, vc = torch.randn(2, 4, 32), torch.randn(8, 16, 2, 32), torch.randn(8, 16, 2, 32)
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    lens, starts = (
        torch.tensor([20, 30], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
    )
    with torch.inference_mode():
        inside = backend.paged_attention(q, kc, vc, table, lens, starts, 0.1)
    outside = backend.paged_attention(q, kc, vc, table, lens, starts, 0.1)
    assert torch.equal(inside, outside)


@pytest.mark.parametrize("name", ["native", "torch"])
def test_paged_attention_takes_keyword_arguments(name):
    b = make_batch([(1, 5), (7, 40), (3, 3)], 4, 2, 64, 16)
    out = cpu_backend(name).paged_attention(
        query=b.query, key_cache=b.key_cache, value_cache=b.value_cache,
        block_table=b.block_table, seq_lens=b.seq_lens, query_start_loc=b.query_start_loc,
        scale=0.125, sliding_window=4, soft_cap=None,
    )  # fmt: skip
    want = paged_attention_ref(*b.args(), 0.125, sliding_window=4)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)


def test_the_registry_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from epdserve.kernels import get_backend\n"
        "for name in ('native', 'torch'):\n"
        "    try:\n"
        "        backend = get_backend(name, 'cpu')\n"
        "    except ValueError:\n"
        "        continue  # native without a C compiler\n"
        "    print(backend.rms_norm(torch.ones(1, 4), torch.ones(4), 0.0).sum().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() and set(done.stdout.split()) == {"4.0"}
