"""The Triton paged attention kernel (under TRITON_INTERPRET=1) matches its torch twin."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernels_testlib import make_batch, random_specs

from epdserve.kernels import paged_attention_ref, paged_attention_triton

pytestmark = pytest.mark.usefixtures("interpreted")

MIXED = [(1, 9), (6, 37), (1, 1), (4, 4), (1, 20)]  # decode, chunked prefill, prefill
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_triton_matches_twin(batch, scale=0.125, window=None, cap=None):
    out = paged_attention_triton(*batch.args(), scale, sliding_window=window, soft_cap=cap)
    ref = paged_attention_ref(*batch.args(), scale, sliding_window=window, soft_cap=cap)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    atol = TOL[batch.query.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


CONFIGS = [  # (group, kv_heads, head_dim, block_size, dtype)
    (1, 2, 64, 16, torch.float32),
    (2, 1, 128, 32, torch.float16),
    (4, 2, 64, 32, torch.float32),
    (8, 1, 64, 16, torch.float16),
    (2, 2, 128, 16, torch.float32),
    (4, 1, 128, 16, torch.float16),
    (2, 2, 32, 16, torch.float32),  # make-model's tiny preset
]


@pytest.mark.parametrize(("group", "kv_heads", "head_dim", "block_size", "dtype"), CONFIGS)
def test_mixed_batch_matches_twin(group, kv_heads, head_dim, block_size, dtype):
    batch = make_batch(MIXED, group * kv_heads, kv_heads, head_dim, block_size, dtype=dtype)
    assert_triton_matches_twin(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_matches_twin(window, dtype):
    assert_triton_matches_twin(make_batch(MIXED, 4, 2, 64, 16, dtype=dtype), window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_soft_cap_matches_twin(dtype):
    batch = make_batch(MIXED, 4, 2, 64, 16, dtype=dtype)
    assert_triton_matches_twin(batch, scale=0.5, cap=2.5)


def test_soft_cap_with_window_matches_twin():
    assert_triton_matches_twin(make_batch(MIXED, 8, 2, 64, 32), cap=2.0, window=7)


def test_contiguous_cache_matches_twin():
    assert_triton_matches_twin(make_batch(MIXED, 4, 2, 64, 16, strided=False))


def test_bf16_inputs_are_computed_in_fp32():
    assert_triton_matches_twin(make_batch(MIXED, 4, 2, 64, 16, dtype=torch.bfloat16))


def test_unwritten_cache_slots_do_not_leak_into_the_output():
    batch = make_batch([(1, 3), (2, 18)], 4, 2, 64, 16)
    clean = paged_attention_triton(*batch.args(), 0.125)
    for seq, ctx in enumerate(batch.seq_lens.tolist()):
        last = int(batch.block_table[seq, (ctx - 1) // 16])
        batch.key_cache[last, ctx % 16 :] = float("nan")
        batch.value_cache[last, ctx % 16 :] = float("nan")
    assert torch.equal(paged_attention_triton(*batch.args(), 0.125), clean)


def test_native_precision_dot_path_matches_twin_in_fp16():
    from epdserve.kernels.attention_triton import launch

    batch = make_batch(MIXED, 8, 2, 64, 16, dtype=torch.float16)
    out = launch(*batch.args(), 0.125, None, None, native_dot=True)
    ref = paged_attention_ref(*batch.args(), 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=0)


@pytest.mark.parametrize("block_q", [1, 2, 4, 16])
@pytest.mark.parametrize("window", [None, 6])
def test_every_query_tile_size_matches_twin(block_q, window):
    from epdserve.kernels.attention_triton import launch

    batch = make_batch([(1, 9), (23, 40), (0, 5), (5, 5), (2, 30)], 8, 2, 64, 16)
    out = launch(*batch.args(), 0.125, window, None, native_dot=False, block_q=block_q)
    ref = paged_attention_ref(*batch.args(), 0.125, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_as_many_queries_as_sequences_is_not_assumed_to_be_decode_only():
    batch = make_batch([(2, 9), (0, 7), (1, 4)], 4, 2, 64, 16)  # T == S == 3
    assert_triton_matches_twin(batch)


def test_block_size_below_sixteen_is_rejected_by_name():
    batch = make_batch([(1, 3)], 2, 1, 16, 8)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention_triton(*batch.args(), 0.25)


@pytest.mark.parametrize("seed", range(2))
def test_random_mixed_batches_match_twin(seed):
    rng = np.random.default_rng(100 + seed)
    group = int(rng.choice([1, 2, 4, 8]))
    kv_heads = int(rng.choice([1, 2]))
    head_dim, block_size = int(rng.choice([64, 128])), int(rng.choice([16, 32]))
    batch = make_batch(random_specs(rng, 5, 40), group * kv_heads, kv_heads, head_dim,
                       block_size, dtype=[torch.float32, torch.float16][seed], seed=seed)  # fmt: skip
    window = int(rng.integers(1, 30)) if seed else None
    assert_triton_matches_twin(batch, window=window, cap=4.0 if seed else None)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_random_sweep_matches_twin(seed):
    rng = np.random.default_rng(1000 + seed)
    group = int(rng.choice([1, 2, 4, 8]))
    kv_heads = int(rng.choice([1, 2, 4]))
    head_dim, block_size = int(rng.choice([64, 128])), int(rng.choice([16, 32]))
    dtype = [torch.float32, torch.float16][seed % 2]
    batch = make_batch(random_specs(rng, 9, 150), group * kv_heads, kv_heads, head_dim,
                       block_size, dtype=dtype, seed=seed)  # fmt: skip
    window = int(rng.integers(1, 100)) if seed % 3 == 0 else None
    cap = float(rng.uniform(1, 30)) if seed % 4 == 0 else None
    assert_triton_matches_twin(batch, window=window, cap=cap)


def test_query_may_be_a_strided_slice_of_a_fused_qkv_tensor():
    batch = make_batch(MIXED, 4, 2, 64, 16)
    qkv = torch.cat([batch.query, torch.zeros_like(batch.query[:, :4])], dim=1)
    args = (qkv[:, :4],) + batch.args()[1:]
    torch.testing.assert_close(
        paged_attention_triton(*args, 0.125), paged_attention_ref(*batch.args(), 0.125)
    )
