"""The CPU twin of paged attention matches a naive dense causal attention.

Every test runs twice: with decode on the C kernel (``native``) and on the torch batched
decode it replaces when no compiler is available.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernels_testlib import make_batch, naive_attention, random_specs

from epdserve.kernels import native, paged_attention_ref

MIXED = [(1, 5), (7, 40), (3, 3), (1, 33), (16, 16), (5, 21)]
DECODE = [(1, 5), (1, 40), (1, 17), (1, 1), (1, 64)]


@pytest.fixture(autouse=True, params=["native", "torch"])
def decode_path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(native, "supports", lambda *args: False)
    elif not native.available():
        pytest.skip("no C compiler: the native decode kernel is not built")
    return request.param


def assert_matches_naive(batch, scale=0.125, window=None, cap=None, atol=2e-5):
    out = paged_attention_ref(*batch.args(), scale, sliding_window=window, soft_cap=cap)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    ref = naive_attention(batch, scale, window, cap)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_naive_for_each_gqa_ratio(group, block_size):
    assert_matches_naive(make_batch(MIXED, 2 * group, 2, 64, block_size))


@pytest.mark.parametrize("group", [1, 4])
def test_all_decode_batch_matches_naive(group):
    assert_matches_naive(make_batch(DECODE, 2 * group, 2, 128, 16))


@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [1, 4, 16, 1000])
def test_sliding_window_keeps_keys_within_the_window(specs, window):
    assert_matches_naive(make_batch(specs, 4, 2, 64, 16), window=window)


@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_soft_cap_is_applied_after_scaling(specs):
    assert_matches_naive(make_batch(specs, 4, 2, 64, 16), scale=0.5, cap=3.0)


def test_soft_cap_and_window_combine():
    assert_matches_naive(make_batch(MIXED, 8, 2, 64, 16), cap=2.0, window=6)


def test_contiguous_cache_gives_the_same_result_as_a_strided_view():
    strided = make_batch(MIXED, 4, 2, 64, 16, seed=3)
    plain = make_batch(MIXED, 4, 2, 64, 16, seed=3, strided=False)
    assert not strided.key_cache.is_contiguous() and plain.key_cache.is_contiguous()
    a = paged_attention_ref(*strided.args(), 0.125)
    b = paged_attention_ref(*plain.args(), 0.125)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_bf16_twin_is_close_to_fp32_naive():
    assert_matches_naive(make_batch(MIXED, 8, 2, 64, 16, dtype=torch.bfloat16), atol=3e-2)


def test_sequences_without_queries_are_skipped():
    batch = make_batch([(2, 9), (0, 7), (1, 4)], 4, 2, 64, 16)
    assert_matches_naive(batch)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_batches_match_naive(seed):
    rng = np.random.default_rng(seed)
    group = [1, 2, 4, 8][seed]
    specs = random_specs(rng, 7, 70)
    assert_matches_naive(make_batch(specs, 2 * group, 2, 64, [16, 32][seed % 2], seed=seed))


def test_twin_does_not_modify_its_inputs():
    batch = make_batch(MIXED, 4, 2, 64, 16)
    before = [t.clone() for t in batch.args()]
    paged_attention_ref(*batch.args(), 0.125)
    assert all(torch.equal(a, b) for a, b in zip(before, batch.args(), strict=True))


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (8, None), (None, 3.0), (8, 3.0)])
def test_each_decode_path_matches_naive(kv_heads, window, cap):
    batch = make_batch(DECODE, 4 * kv_heads, kv_heads, 64, 16)
    assert_matches_naive(batch, window=window, cap=cap)


@pytest.mark.parametrize(
    ("kv_heads", "head_dim"), [(1, 64), (2, 32), (2, 64), (4, 128), (8, 64), (8, 128)]
)
def test_bf16_decode_paths_are_close_to_naive(kv_heads, head_dim):
    batch = make_batch(DECODE, 2 * kv_heads, kv_heads, head_dim, 16, dtype=torch.bfloat16)
    assert_matches_naive(batch, atol=3e-2)


def test_results_do_not_alias_the_reused_buffers():
    first = make_batch(DECODE, 4, 1, 64, 16, seed=1)
    out = paged_attention_ref(*first.args(), 0.125)
    kept = out.clone()
    paged_attention_ref(*make_batch(DECODE, 4, 1, 64, 16, seed=2).args(), 0.125)
    assert torch.equal(out, kept)


@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize(("kv_heads", "dtype"), [(2, torch.float32), (2, torch.bfloat16),
                                                 (1, torch.bfloat16), (8, torch.bfloat16)])  # fmt: skip
def test_query_may_be_a_strided_slice_of_a_fused_qkv_tensor(specs, kv_heads, dtype):
    batch = make_batch(specs, 8, kv_heads, 64, 16, dtype=dtype)
    qkv = torch.cat([batch.query, torch.zeros_like(batch.query[:, :4])], dim=1)
    sliced = qkv[:, :8]
    assert not sliced.is_contiguous()
    args = (sliced,) + batch.args()[1:]
    torch.testing.assert_close(
        paged_attention_ref(*args, 0.125), paged_attention_ref(*batch.args(), 0.125)
    )


def test_ragged_decode_batch_split_into_length_groups_matches_naive():
    lens = [3, 200, 5, 180, 9, 17, 190, 2, 160, 7, 12, 170]
    batch = make_batch([(1, n) for n in lens], 4, 2, 64, 16)
    assert_matches_naive(batch)
    assert_matches_naive(batch, window=20, cap=5.0)


def test_mixed_batch_with_ragged_decodes_matches_naive():
    specs = [(1, n) for n in (3, 200, 5, 180, 9, 190, 2, 160)] + [(6, 40), (9, 9)]
    assert_matches_naive(make_batch(specs, 8, 2, 64, 16))
