"""The C KV-cache write against its torch twin: bit-equal caches, padding skipped, bad
slots refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from epdserve.kernels import native
from epdserve.kernels.backends import NativeBackend
from epdserve.kernels.cache_ref import reshape_and_cache_ref

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")

BLOCKS, LAYERS, BLOCK, HEADS, DIM = 9, 3, 16, 2, 8


def cross_layer_cache(dtype):
    """The engine's layout: one tensor for every layer, per-layer strided views."""
    kv = torch.randn(BLOCKS, LAYERS, 2, BLOCK, HEADS, DIM).to(dtype)
    return kv, kv[:, 1, 0], kv[:, 1, 1]


def qkv_views(tokens: int, dtype):
    """Key and value as the model hands them over: slices of one fused qkv row."""
    qkv = torch.randn(tokens, (4 + 2 * HEADS) * DIM).to(dtype)
    k = qkv[:, 4 * DIM : (4 + HEADS) * DIM].view(tokens, HEADS, DIM)
    v = qkv[:, (4 + HEADS) * DIM :].view(tokens, HEADS, DIM)
    return k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_equals_the_twin_with_strided_rows_and_padding(dtype, index_dtype, tokens):
    k, v = qkv_views(tokens, dtype)
    slots = torch.randperm(BLOCKS * BLOCK)[:tokens].to(index_dtype)
    if tokens > 2:
        slots[1] = -1  # padding
    kv, kc, vc = cross_layer_cache(dtype)
    expected = kv.clone()
    reshape_and_cache_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    assert native.cache_write_supports(k, v, kc, vc, slots)
    NativeBackend().reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(kv, expected)  # the other layers and K/V halves untouched too


def test_a_slot_out_of_range_is_refused_and_nothing_is_written():
    k, v = qkv_views(4, torch.float32)
    kv, kc, vc = cross_layer_cache(torch.float32)
    before = kv.clone()
    slots = torch.tensor([0, 5, BLOCKS * BLOCK, 7])
    with pytest.raises(IndexError, match="slot_mapping"):
        NativeBackend().reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(kv, before)


def test_layouts_it_cannot_take_go_to_the_twin():
    k, v = qkv_views(5, torch.float32)
    kv, kc, vc = cross_layer_cache(torch.float32)
    strided_heads = k.transpose(1, 2).contiguous().transpose(1, 2)  # heads not adjacent
    assert not native.cache_write_supports(strided_heads, v, kc, vc, torch.arange(5))
    expected = kv.clone()
    reshape_and_cache_ref(strided_heads, v, expected[:, 1, 0], expected[:, 1, 1], torch.arange(5))
    NativeBackend().reshape_and_cache(strided_heads, v, kc, vc, torch.arange(5))
    assert torch.equal(kv, expected)


def test_bad_arguments_are_named_before_the_kernel_runs():
    k, v = qkv_views(3, torch.float32)
    _, kc, vc = cross_layer_cache(torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        NativeBackend().reshape_and_cache(k, v, kc, vc, torch.arange(2))
