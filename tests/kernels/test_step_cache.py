"""The step's shared attention work (``AttentionMetadata.step_cache``): what the attention
kernels derive from the batch geometry is derived once per step, by the first layer, and the
others reuse it; a call with the cache gives what a call without it gives, every layer alike
(windows, soft caps and decode-only or mixed batches)."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import cpu_backend, make_batch

from epdserve.engine.models.decoder import AttentionMetadata
from epdserve.kernels import attention_ref, attention_triton
from epdserve.kernels.attention_triton import paged_attention_triton

MIXED = [(1, 5), (7, 40), (1, 33), (3, 3)]
DECODE = [(1, 5), (1, 40), (1, 17)]
LAYERS = [dict(), dict(sliding_window=4), dict(soft_cap=2.0), dict(sliding_window=9)]


@pytest.mark.parametrize("name", ["native", "torch"])
@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_a_shared_cache_gives_each_layer_what_it_gets_alone(name, specs, monkeypatch):
    backend = cpu_backend(name)
    b = make_batch(specs, 4, 2, 64, 16, dtype=torch.bfloat16)
    built = []
    real = attention_ref._Lengths
    monkeypatch.setattr(
        attention_ref, "_Lengths", lambda *a: built.append(1) or real(*a)
    )  # counts each derivation
    cache: dict = {}
    for layer in LAYERS:
        shared = backend.paged_attention(*b.args(), 0.125, **layer, step_cache=cache)
        alone = backend.paged_attention(*b.args(), 0.125, **layer)
        assert torch.equal(shared, alone)
    assert len(built) == 1 + len(LAYERS)  # once for the shared cache, once per lone call


def test_a_new_step_starts_from_its_own_cache():
    """A step's metadata brings a fresh cache: another geometry is derived anew."""
    backend = cpu_backend("torch")
    first, second = make_batch(MIXED, 4, 2, 64, 16), make_batch(DECODE, 4, 2, 64, 16)
    metas = [
        AttentionMetadata(None, None, b.block_table, b.seq_lens, b.query_start_loc)
        for b in (first, second)
    ]
    assert metas[0].step_cache is not metas[1].step_cache
    for b, meta in zip((first, second), metas, strict=True):
        out = backend.paged_attention(*b.args(), 0.125, step_cache=meta.step_cache)
        assert torch.equal(out, backend.paged_attention(*b.args(), 0.125))


def test_the_triton_tile_map_is_built_once_per_step(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    b = make_batch(MIXED, 4, 2, 64, 16)
    built = []
    real = attention_triton._tiles
    monkeypatch.setattr(attention_triton, "_tiles", lambda *a: built.append(a[1:]) or real(*a))
    cache: dict = {}
    for layer in LAYERS[:2]:
        shared = paged_attention_triton(*b.args(), 0.125, **layer, step_cache=cache)
        alone = paged_attention_triton(*b.args(), 0.125, **layer)
        assert torch.equal(shared, alone)
    assert len(built) == 3  # the shared cache's one, and one per lone call
