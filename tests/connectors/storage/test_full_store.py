"""A full store degrades to recompute, never to an error: a real redis-server out of memory
with `noeviction` (a misconfigured external Redis) and an unwritable shared volume. Saves fail
and are counted, loads miss (the engine recomputes), and nothing stays tripped afterwards."""

from __future__ import annotations

import time

import pytest
import redis
import torch

from epdserve.connectors.kv_connector import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorRole,
    KVLayout,
    KVTransferConfig,
    RedisConnector,
    SharedStorageConnector,
)

LAYOUT = KVLayout("fp-full", 4, "sha256_cbor", 2)
HASHES = [bytes([i]) * 32 for i in range(1, 5)]
BLOCK_IDS = [1, 2, 3, 4]
VALUE = b"x" * (16 << 10)


@pytest.fixture
def full_redis(redis_url):
    """``fill(headroom)``: the server may hold `headroom` more bytes, then refuses writes with
    OOM (noeviction); the server's own settings come back afterwards."""
    client = redis.Redis.from_url(redis_url)
    saved = {k: client.config_get(k)[k] for k in ("maxmemory", "maxmemory-policy")}

    def fill(headroom: int) -> None:
        used = client.info("memory")["used_memory"]
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", str(max(1, used + headroom) if headroom else 1))

    yield fill
    client.config_set("maxmemory", saved["maxmemory"])
    client.config_set("maxmemory-policy", saved["maxmemory-policy"])
    client.flushall()
    client.close()


def _until(condition, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
    return result


def _worker(cls, extra: dict) -> RedisConnector | SharedStorageConnector:
    config = KVTransferConfig(cls.__name__, "kv_both", {"pool": "full", **extra})
    worker = cls(config, KVConnectorRole.WORKER, LAYOUT)
    worker.register_kv_caches(torch.randn(8, 2, 2, 4, 2, 8))
    return worker


def _save(worker, req_id: str = "r") -> None:
    """One step's saves, then poll until the request's saves are done (as the engine does)."""
    worker.bind_connector_metadata(
        KVConnectorMetadata(saves=[BlockTransfer(req_id, BLOCK_IDS, HASHES)])
    )
    worker.wait_for_save()
    _until(lambda: req_id in worker.get_finished({req_id})[0])


def _load(worker, req_id: str = "l") -> set[int]:
    """One step's loads, polled to the end; returns the blocks to recompute."""
    worker.bind_connector_metadata(
        KVConnectorMetadata(loads=[BlockTransfer(req_id, BLOCK_IDS, HASHES)])
    )
    worker.start_load_kv()
    _until(lambda: req_id in worker.get_finished(set())[1])
    return worker.get_block_ids_with_load_errors()


def test_an_out_of_memory_redis_fails_puts_softly_and_keeps_what_fit(make_store, full_redis):
    # one value per round trip: a pipelined batch would count against maxmemory in whole, as
    # the server's input buffer, and be refused before any of it is stored
    store = make_store("redis", chunk_keys=1)
    full_redis(headroom=256 << 10)  # room for a few 16 KiB values, not for 64
    keys = [f"epd:kv:full:fp:{i:02x}" for i in range(64)]
    done = store.put_many([(k, VALUE) for k in keys])
    assert 0 < sum(done) < len(keys)
    assert store.stats.put_failures == len(keys) - sum(done)
    assert store.get_many(keys) == [VALUE if ok else None for ok in done]
    assert not store.breaker.is_down  # an OOM reply is a refused write, not a dead server


def test_a_connector_on_a_full_redis_counts_failed_saves_and_loads_miss(redis_url, full_redis):
    worker = _worker(RedisConnector, {"url": redis_url, "ttl_s": 60})
    try:
        full_redis(headroom=0)
        _save(worker)
        assert worker.stats().save_failures == len(HASHES)
        assert worker.store.stats.put_failures == len(HASHES)
        assert worker.kv_io.count_cached_prefix(HASHES) == 0  # scheduler side: nothing to load
        assert _load(worker) == set(BLOCK_IDS)  # every block is recomputed
    finally:
        worker.close()


def test_saves_resume_once_the_full_redis_has_room_again(redis_url, full_redis):
    worker = _worker(RedisConnector, {"url": redis_url})
    try:
        full_redis(headroom=0)
        _save(worker, "before")
        redis.Redis.from_url(redis_url).config_set("maxmemory", "0")  # the operator fixed it
        _save(worker, "after")
        assert worker.stats().saved == len(HASHES)
        assert _load(worker) == set()  # nothing left to recompute
    finally:
        worker.close()


def test_a_connector_on_an_unwritable_volume_counts_failed_saves_and_loads_miss(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"")  # the store's directory cannot be created below a file
    worker = _worker(SharedStorageConnector, {"path": str(blocker / "kv"), "max_bytes": 1 << 20})
    try:
        _save(worker)
        assert worker.stats().save_failures == len(HASHES)
        assert worker.store.stats.put_failures == len(HASHES)
        assert _load(worker) == set(BLOCK_IDS)
    finally:
        worker.close()
