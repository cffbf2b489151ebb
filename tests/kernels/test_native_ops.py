"""The C per-token ops (``csrc/cpu_ops.c``) equal their torch twins bit for bit."""

from __future__ import annotations

import pytest
import torch

from epdserve.engine.models.rope import cos_sin_cache
from epdserve.kernels import native
from epdserve.kernels.backends import NativeBackend
from epdserve.kernels.norm_ref import rms_norm_ref
from epdserve.kernels.rotary_ref import rotary_embedding_ref

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the kernels")
NATIVE = NativeBackend()  # the C kernels where they take the tensors, else the twins


def rope_case(dtype, tokens=37, heads=6, kv_heads=2, head_dim=64, rot_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tokens, heads, head_dim, generator=gen) * 3).to(dtype)
    k = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    cache = torch.randn(4096, rot_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    return positions, q, k, cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_equals_the_torch_twin_bit_for_bit(dtype, is_neox, rot_dim):
    positions, q, k, cache = rope_case(dtype, rot_dim=rot_dim)
    assert native.rotary_supports(positions, q, k, cache)
    q_ref, k_ref = rotary_embedding_ref(positions, q.clone(), k.clone(), cache, is_neox)
    q_out, k_out = NATIVE.rotary_embedding(positions, q, k, cache, is_neox)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_rotary_with_a_real_cache_keeps_position_zero_and_matches_the_twin():
    cache = cos_sin_cache({"rope_theta": 10000.0}, 32, 2048, torch.float32).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 7, 2047])
    q = torch.randn(4, 4, 32).bfloat16()
    k = torch.randn(4, 2, 32).bfloat16()
    q0 = q.clone()
    q_ref, k_ref = rotary_embedding_ref(positions, q.clone(), k.clone(), cache, True)
    NATIVE.rotary_embedding(positions, q, k, cache, True)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(q[0], q0[0])


def test_rotary_nan_and_inf_propagate_as_in_the_twin():
    positions, q, k, cache = rope_case(torch.bfloat16, tokens=3)
    q[0, 0, 0], q[1, 1, 3], k[2, 0, 5] = float("nan"), float("inf"), float("-inf")
    q_ref, k_ref = rotary_embedding_ref(positions, q.clone(), k.clone(), cache, True)
    NATIVE.rotary_embedding(positions, q, k, cache, True)
    torch.testing.assert_close(q, q_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(k, k_ref, equal_nan=True, atol=0, rtol=0)


def test_rotary_position_outside_the_cache_is_refused_before_any_write():
    positions, q, k, cache = rope_case(torch.bfloat16, tokens=4)
    positions[2] = 4096
    before = q.clone()
    with pytest.raises(IndexError, match="positions"):
        NATIVE.rotary_embedding(positions, q, k, cache, True)
    assert torch.equal(q, before)


def test_rotary_layouts_the_kernel_does_not_take_use_the_twin():
    positions, q, k, cache = rope_case(torch.float16)
    assert not native.rotary_supports(positions, q, k, cache)
    positions, q, k, cache = rope_case(torch.bfloat16)
    assert not native.rotary_supports(positions, q[:, :3], k, cache)  # not contiguous
    assert not native.rotary_supports(positions, q, k, cache.float())  # mixed dtypes
    q_ref, k_ref = rotary_embedding_ref(positions, q.clone(), k.clone(), cache.float(), True)
    NATIVE.rotary_embedding(positions, q, k, cache.float(), True)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


needs_x86_sum = pytest.mark.skipif(
    not native._X86_SUM, reason="the mean's summation order is torch's x86 sum kernel's"
)


@needs_x86_sum
@pytest.mark.parametrize("hidden", [16, 100, 128, 896, 2049, 4096, 16384])
@pytest.mark.parametrize(
    ("dtype", "wdtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ],
)
def test_rms_norm_equals_the_torch_twin_bit_for_bit(hidden, dtype, wdtype):
    """Sizes below one vector, with a scalar tail, and long enough for the sum's cascade."""
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(64, hidden, generator=gen) * torch.rand(64, 1, generator=gen) * 10).to(dtype)
    residual = torch.randn(64, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(wdtype)
    x0, r0 = x.clone(), residual.clone()
    assert native.rms_norm_supports(x, weight, residual)
    assert torch.equal(NATIVE.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    out, new_residual = NATIVE.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(out, ref_out) and torch.equal(new_residual, ref_residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs not modified


@needs_x86_sum
def test_rms_norm_of_per_head_rows_and_non_finite_values_match_the_twin():
    x = torch.randn(5, 4, 32).bfloat16()  # q/k norms: [T, H, D], normalized over D
    x[0, 1, 3], x[2, 0, 0] = float("nan"), float("inf")
    x[3, 2] = 0.0  # eps 0: 0 * inf = nan in both
    w = torch.randn(32).bfloat16()
    for eps in (1e-6, 0.0):
        got, ref = NATIVE.rms_norm(x, w, eps), rms_norm_ref(x, w, eps)
        torch.testing.assert_close(got, ref, equal_nan=True, atol=0, rtol=0)


def test_rms_norm_layouts_the_kernel_does_not_take_use_the_twin():
    x = torch.randn(8, 64).half()
    w = torch.randn(64).half()
    assert not native.rms_norm_supports(x, w, None)
    assert torch.equal(NATIVE.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    xb = torch.randn(64, 8).bfloat16().t()  # not contiguous
    assert not native.rms_norm_supports(xb, w.bfloat16(), None)
    assert torch.equal(
        NATIVE.rms_norm(xb, w.bfloat16(), 1e-6), rms_norm_ref(xb, w.bfloat16(), 1e-6)
    )
