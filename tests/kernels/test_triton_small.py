"""Triton reshape_and_cache, rms_norm and rotary_embedding (interpreted) match their twins."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import cross_layer_cache

from epdserve.kernels import (
    reshape_and_cache_ref,
    reshape_and_cache_triton,
    rms_norm_ref,
    rms_norm_triton,
    rotary_embedding_ref,
    rotary_embedding_triton,
)

pytestmark = pytest.mark.usefixtures("interpreted")
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reshape_and_cache_writes_the_same_cache_as_the_twin(dtype, head_dim):
    kv, key_cache, value_cache = cross_layer_cache(5, 16, 2, head_dim, dtype)
    kv_ref = kv.clone()
    key, value = torch.randn(6, 2, head_dim).to(dtype), torch.randn(6, 2, head_dim).to(dtype)
    slots = torch.tensor([3, -1, 17, 79, 40, -1])
    reshape_and_cache_triton(key, value, key_cache, value_cache, slots)
    reshape_and_cache_ref(key, value, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots)
    assert torch.equal(kv, kv_ref)


def test_reshape_and_cache_accepts_int32_slots_and_block_size_32():
    kv, key_cache, value_cache = cross_layer_cache(3, 32, 1, 64, torch.float32)
    key = torch.randn(2, 1, 64)
    reshape_and_cache_triton(key, -key, key_cache, value_cache, torch.tensor([70, 31]).int())
    assert torch.equal(key_cache[2, 6], key[0]) and torch.equal(value_cache[0, 31], -key[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_twin(dtype, hidden):
    x, w = torch.randn(3, 5, hidden).to(dtype), torch.randn(hidden).to(dtype)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_matches_twin(dtype):
    x, r, w = (torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype),
               torch.randn(64).to(dtype))  # fmt: skip
    out, new_res = rms_norm_triton(x, w, 1e-5, residual=r)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, residual=r)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (128, 64)])
def test_rotary_matches_twin(dtype, is_neox, head_dim, rot_dim):
    positions = torch.tensor([0, 9, 4, 31, 2])
    cache = torch.randn(32, rot_dim)
    q, k = torch.randn(5, 8, head_dim).to(dtype), torch.randn(5, 2, head_dim).to(dtype)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_triton(positions, q, k, cache, is_neox)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, is_neox)
    torch.testing.assert_close(q, q_ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(k, k_ref, atol=2e-3, rtol=2e-3)
