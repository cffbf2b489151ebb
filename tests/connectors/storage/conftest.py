"""Fixtures for the storage conformance and fault tests: one store per backend."""

from __future__ import annotations

import os

import pytest
import torch

from epdserve.connectors.storage import (
    KVBlockMeta,
    RedisBlockStore,
    RedisStoreConfig,
    SharedStorageBlockStore,
    SharedStorageConfig,
)

BACKENDS = ("redis", "shared_storage")
META = KVBlockMeta(fingerprint="tiny-llama-0123", block_size=4, hash_algo="sha256_cbor")
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


class RawValues:
    """Reads and damages stored values behind the store's back: Redis commands on the server,
    plain file operations on the volume (what a faulty disk, a bad copy or a hostile writer
    does)."""

    def __init__(self, store):
        self.store = store
        self.client = None
        if hasattr(store.config, "url"):
            import redis

            self.client = redis.Redis.from_url(store.config.url)

    def get(self, key: str) -> bytes | None:
        if self.client is not None:
            return self.client.get(key)
        try:
            with open(self.store.path_of(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def set(self, key: str, value: bytes) -> None:
        if self.client is not None:
            self.client.set(key, value)
            return
        with open(self.store.path_of(key), "wb") as f:
            f.write(value)

    def exists(self, key: str) -> bool:
        return self.get(key) is not None

    def flip_bit(self, key: str, offset: int, bit: int = 0) -> None:
        """Flip one bit in place (``SETRANGE`` on Redis, a one-byte write on disk);
        a negative ``offset`` counts from the end."""
        value = self.get(key)
        offset %= len(value)
        byte = bytes([value[offset] ^ (1 << bit)])
        if self.client is not None:
            self.client.setrange(key, offset, byte)
            return
        with open(self.store.path_of(key), "r+b") as f:
            f.seek(offset)
            f.write(byte)

    def truncate(self, key: str, size: int) -> None:
        if self.client is not None:
            self.client.set(key, self.get(key)[:size])
            return
        os.truncate(self.store.path_of(key), size)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


@pytest.fixture
def raw(store):
    """Raw access to ``store``'s values (see ``RawValues``)."""
    values = RawValues(store)
    yield values
    values.close()
