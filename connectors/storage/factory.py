"""Registry of storage backends and the factory that picks one from config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from epdserve.connectors.storage.base import BlockStore
from epdserve.connectors.storage.file_store import SharedStorageBlockStore, SharedStorageConfig
from epdserve.connectors.storage.redis_store import RedisBlockStore, RedisStoreConfig

# backend name -> (config dataclass, store class)
STORE_BACKENDS: dict[str, tuple[type, type[BlockStore]]] = {
    "redis": (RedisStoreConfig, RedisBlockStore),
    "shared_storage": (SharedStorageConfig, SharedStorageBlockStore),
}


def register_store(name: str, config_cls: type, store_cls: type[BlockStore]) -> None:
    """Make ``{"backend": name, ...}`` build ``store_cls(config_cls(...))``."""
    STORE_BACKENDS[name] = (config_cls, store_cls)


def store_config(config: Mapping[str, Any]) -> Any:
    """The typed config for a plain mapping: ``{"url": "redis://..."}`` -> Redis,
    ``{"path": "/cache/kv"}`` -> shared storage, or an explicit ``{"backend": name, ...}``."""
    options = dict(config)
    backend = options.pop("backend", None)
    if backend is None:
        if "url" in options:
            backend = "redis"
        elif "path" in options:
            backend = "shared_storage"
        else:
            raise ValueError(
                "store config needs 'backend', 'url' (Redis) or 'path' (shared storage)"
            )
    if backend not in STORE_BACKENDS:
        raise ValueError(f"backend must be one of {sorted(STORE_BACKENDS)}, got {backend!r}")
    config_cls = STORE_BACKENDS[backend][0]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown {backend} store option(s) {unknown}; known: {sorted(known)}")
    return config_cls(**options)


def create_store(config: Mapping[str, Any] | Any) -> BlockStore:
    """A store from a mapping (see ``store_config``) or from a registered config dataclass."""
    if isinstance(config, Mapping):
        config = store_config(config)
    for config_cls, store_cls in STORE_BACKENDS.values():
        if type(config) is config_cls:
            return store_cls(config)
    raise ValueError(f"no store backend is registered for {type(config).__name__}")
