"""Fixtures for the storage conformance and fault tests: one store per backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # raw_values, shared with the P/D pool tests
from raw_values import RawValues  # noqa: E402

from epdserve.connectors.storage import (
    KVBlockMeta,
    RedisBlockStore,
    RedisStoreConfig,
    SharedStorageBlockStore,
    SharedStorageConfig,
)

BACKENDS = ("redis", "shared_storage")
META = KVBlockMeta(
    fingerprint="tiny-llama-0123", block_size=4, hash_algo="sha256_cbor", num_kv_heads=2
)
# [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
CACHE_SHAPE = (8, 2, 2, 4, 2, 8)


def _make_cache(dtype=torch.float32, seed=0, shape=CACHE_SHAPE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.fixture
def meta() -> KVBlockMeta:
    """Metadata of the tiny test model's stored KV blocks."""
    return META


@pytest.fixture
def make_cache():
    """``make_cache(dtype, seed, shape)``: a random paged KV cache of the tiny test geometry."""
    return _make_cache


@pytest.fixture
def make_store(request, tmp_path):
    """``make_store(backend, **config_overrides)``; every store made is closed afterwards."""
    made = []

    def make(backend: str, **overrides):
        if backend == "redis":
            url = request.getfixturevalue("redis_url")
            options = dict(url=url, socket_timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=0.2)
            store = RedisBlockStore(RedisStoreConfig(**{**options, **overrides}))
        else:
            options = dict(path=str(tmp_path / "volume" / "kv"))
            store = SharedStorageBlockStore(SharedStorageConfig(**{**options, **overrides}))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture(params=BACKENDS)
def store(request, make_store):
    return make_store(request.param)


@pytest.fixture
def raw(store):
    """Raw access to ``store``'s values (see ``RawValues``)."""
    values = RawValues(store)
    yield values
    values.close()
