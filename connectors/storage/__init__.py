"""Storage layer of the KV and encoder-cache connectors (DESIGN.md §3-4).

``BlockStore`` (Redis or shared storage, picked by ``create_store(config)``) moves whole
values; ``KVBlockIO`` / ``EncoderOutputIO`` turn cache tensors into keyed safetensors values
and back; ``AsyncBlockStore`` runs that work on background threads. No call raises because
the backend is down, slow, full, read-only or returns garbage: it is a miss (or ``False``)
and a counter in ``.stats``. Typical use by a KV connector::

    store = create_store({"url": "redis://cache:6379/0"})  # or {"path": "/cache/kv"}
    meta = KVBlockMeta(fingerprint(model, dtype), block_size, "sha256_cbor", num_kv_heads)
    kv_io = KVBlockIO(store, pool, meta, heads=HeadSlice(first, count))  # a TP rank's heads
    n = kv_io.count_cached_prefix(block_hashes)  # scheduler side: blocks with every head stored
    worker = AsyncBlockStore(store)
    done = worker.submit(kv_io.load, kv_cache, block_ids, block_hashes)  # -> Future[list[bool]]
    worker.submit(kv_io.save, kv_cache, block_ids, block_hashes)

Names are exported lazily so ``import epdserve.connectors.storage.redis_store`` stays light.
"""

import importlib

_EXPORTS = {
    "BlockStore": "base",
    "StoreStats": "base",
    "CircuitBreaker": "base",
    "AsyncBlockStore": "async_store",
    "RedisStoreConfig": "redis_store",
    "RedisBlockStore": "redis_store",
    "SharedStorageConfig": "file_store",
    "SharedStorageBlockStore": "file_store",
    "create_store": "factory",
    "store_config": "factory",
    "register_store": "factory",
    "KVBlockMeta": "kv_codec",
    "KVPart": "kv_codec",
    "EncoderOutputMeta": "codec",
    "encode_kv_block": "kv_codec",
    "decode_kv_block": "kv_codec",
    "encode_encoder_output": "codec",
    "decode_encoder_output": "codec",
    "kv_key": "keys",
    "ec_key": "keys",
    "fingerprint": "keys",
    "KVBlockIO": "kv_io",
    "HeadSlice": "kv_io",
    "EncoderOutputIO": "transfer",
    "TransferStats": "transfer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
