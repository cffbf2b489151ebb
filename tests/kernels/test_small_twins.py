"""Torch twins of reshape_and_cache, rms_norm and rotary_embedding match their definitions."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import cpu_backend, cross_layer_cache

from epdserve.kernels import reshape_and_cache_ref, rms_norm_ref, rotary_embedding_ref

CPU_BACKENDS = pytest.mark.parametrize("name", ["native", "torch"])


def test_reshape_and_cache_writes_each_token_to_its_slot_in_a_strided_view():
    kv, key_cache, value_cache = cross_layer_cache(4, 16, 2, 8, torch.float32)
    before = kv.clone()
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reshape_and_cache_ref(key, value, key_cache, value_cache, torch.tensor([17, 5, 63]))
    for t, slot in enumerate([17, 5, 63]):
        assert torch.equal(kv[slot // 16, 1, 0, slot % 16], key[t])
        assert torch.equal(kv[slot // 16, 1, 1, slot % 16], value[t])
    kv[1, 1, :, 1], kv[0, 1, :, 5], kv[3, 1, :, 15] = before[1, 1, :, 1], before[0, 1, :, 5], before[3, 1, :, 15]  # fmt: skip
    assert torch.equal(kv, before), "only the three slots of layer 1 may change"


def test_reshape_and_cache_skips_slot_minus_one():
    kv, key_cache, value_cache = cross_layer_cache(2, 16, 1, 8, torch.float32)
    before = kv.clone()
    reshape_and_cache_ref(
        torch.randn(2, 1, 8), torch.randn(2, 1, 8), key_cache, value_cache, torch.tensor([-1, -1])
    )
    assert torch.equal(kv, before)


@CPU_BACKENDS
def test_cpu_backends_write_the_cache_with_int32_slots(name):
    _, key_cache, value_cache = cross_layer_cache(2, 16, 1, 8, torch.float32)
    key = torch.randn(1, 1, 8)
    slots = torch.tensor([20], dtype=torch.int32)
    cpu_backend(name).reshape_and_cache(key, key, key_cache, value_cache, slots)
    assert torch.equal(key_cache[1, 4], key[0])


def test_rms_norm_normalises_in_fp32_and_scales_as_hf_does_for_the_weight_dtype():
    x = torch.randn(3, 4, 32).to(torch.bfloat16)
    xf = x.float()
    normalized = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    w = torch.randn(32).to(torch.bfloat16)  # Llama/Qwen: weight * hidden.to(input_dtype)
    out = rms_norm_ref(x, w, 1e-5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, w * normalized.bfloat16())
    w32 = 1 + torch.randn(32)  # Gemma's fp32 (1 + w): all in fp32, rounded once
    assert torch.equal(rms_norm_ref(x, w32, 1e-5), (normalized * w32).bfloat16())


@CPU_BACKENDS
def test_rms_norm_with_residual_returns_the_norm_of_the_sum_and_the_sum(name):
    x, r, w = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16)
    out, new_residual = cpu_backend(name).rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(new_residual, x + r)
    torch.testing.assert_close(out, rms_norm_ref(x + r, w, 1e-6))


def test_rms_norm_leaves_its_inputs_unchanged():
    x, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    x0, r0 = x.clone(), r.clone()
    rms_norm_ref(x, w, 1e-6, residual=r)
    assert torch.equal(x, x0) and torch.equal(r, r0)


def cos_sin(max_pos, rot_dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def hf_rotate_half(x, cos, sin):
    """HF Llama: ``x * cos + rotate_half(x) * sin`` with cos/sin duplicated over halves."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cat([cos, cos], -1) + rotated * torch.cat([sin, sin], -1)


def gptj_interleaved(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_rotates_the_first_rot_dim_dims_in_place(is_neox):
    positions = torch.tensor([0, 7, 3, 100])
    cache = cos_sin(128, 32)
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    q0, k0 = q.clone(), k.clone()
    out_q, out_k = rotary_embedding_ref(positions, q, k, cache, is_neox)
    assert out_q is q and out_k is k
    cos, sin = cache[positions, :16][:, None], cache[positions, 16:][:, None]
    rotate = hf_rotate_half if is_neox else gptj_interleaved
    for new, old in ((q, q0), (k, k0)):
        torch.testing.assert_close(new[..., :32], rotate(old[..., :32], cos, sin))
        assert torch.equal(new[..., 32:], old[..., 32:])


@CPU_BACKENDS
def test_rotary_at_position_zero_is_identity(name):
    q, k = torch.randn(1, 2, 16), torch.randn(1, 1, 16)
    q0, k0 = q.clone(), k.clone()
    cpu_backend(name).rotary_embedding(torch.tensor([0]), q, k, cos_sin(4, 16), True)
    assert torch.equal(q, q0) and torch.equal(k, k0)
