"""The registry/factory picks a backend from plain config."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from epdserve.connectors.storage import (
    RedisBlockStore,
    RedisStoreConfig,
    SharedStorageBlockStore,
    SharedStorageConfig,
    create_store,
    register_store,
    store_config,
)
from epdserve.connectors.storage.base import BlockStore
from epdserve.connectors.storage.factory import STORE_BACKENDS


def test_a_url_selects_redis_and_a_path_selects_shared_storage(tmp_path):
    assert store_config({"url": "redis://r:6379/0", "ttl_s": 60}) == RedisStoreConfig(
        url="redis://r:6379/0", ttl_s=60
    )
    assert store_config({"path": "/cache/kv"}) == SharedStorageConfig(path="/cache/kv")
    with create_store({"url": "redis://127.0.0.1:1/0"}) as store:
        assert isinstance(store, RedisBlockStore)
    with create_store(SharedStorageConfig(path=str(tmp_path))) as store:
        assert isinstance(store, SharedStorageBlockStore)


@pytest.mark.parametrize(
    "config,message",
    [
        ({}, "needs 'backend'"),
        ({"backend": "s3"}, "backend must be one of"),
        ({"url": "redis://h/0", "tll_s": 5}, r"unknown redis store option\(s\) \['tll_s'\]"),
        ({"url": "http://h/0"}, "url must be"),
        ({"url": "redis://h/0", "socket_timeout_s": 0}, "socket_timeout_s must be > 0"),
        ({"path": "/x", "max_bytes": -1}, "max_bytes must be"),
        ({"path": "/x", "evict_to": 1.5}, "evict_to must be"),
    ],
)
def test_bad_configs_are_rejected_with_the_field_named(config, message):
    with pytest.raises(ValueError, match=message):
        store_config(config)


def test_a_registered_backend_is_built_from_its_name():
    @dataclass(frozen=True)
    class MemoryConfig:
        capacity: int = 10

    class MemoryStore(BlockStore):
        def __init__(self, config):
            self.config = config

        put_many = get_many = exists_many = delete_many = close = lambda self, *a: None

    register_store("memory", MemoryConfig, MemoryStore)
    try:
        store = create_store({"backend": "memory", "capacity": 3})
        assert isinstance(store, MemoryStore) and store.config == MemoryConfig(3)
    finally:
        del STORE_BACKENDS["memory"]
