"""One conformance suite, run against every backend (real redis-server; a tmp directory)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from epdserve.connectors.storage import (
    AsyncBlockStore,
    EncoderOutputIO,
    KVBlockIO,
    KVBlockMeta,
    encode_kv_block,
)

ROOT = Path(__file__).resolve().parents[3]
HASHES = [bytes([i]) * 32 for i in range(1, 5)]


# staged: the host-staging path a device cache takes (pinned buffers there), run on CPU
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_blocks_round_trip_bit_exact(store, meta, make_cache, dtype, staged):
    source, dest = make_cache(dtype), torch.zeros(make_cache(dtype).shape, dtype=dtype)
    saver = KVBlockIO(store, "pool", meta, staging=staged)
    assert saver.save(source, [1, 2, 3, 4], HASHES) == [True] * 4
    io = KVBlockIO(store, "pool", meta, staging=staged)
    assert io.count_cached_prefix(HASHES) == 4
    assert io.load(dest, [7, 6, 5, 4], HASHES) == [True] * 4
    for src, dst in zip([1, 2, 3, 4], [7, 6, 5, 4], strict=True):
        assert torch.equal(dest[dst].view(torch.uint8), source[src].view(torch.uint8))
    assert dest[:4].count_nonzero() == 0
    assert (io.stats.loaded, io.stats.misses, io.stats.rejected) == (4, 0, 0)


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_missing_keys_are_misses_and_leave_slots_untouched(store, meta, make_cache, staged):
    io = KVBlockIO(store, "pool", meta, staging=staged)
    io.save(make_cache(), [1], HASHES[:1])
    dest = torch.zeros(make_cache().shape)
    assert io.load(dest, [1, 2], [HASHES[1], HASHES[0]]) == [False, True]
    assert dest[1].count_nonzero() == 0
    assert (io.stats.lookups, io.stats.loaded, io.stats.misses) == (2, 1, 1)
    assert io.count_cached_prefix(HASHES) == 1 and io.count_cached_prefix(HASHES[1:]) == 0
    assert store.get_many(["epd:kv:pool:nothing:00"]) == [None]
    assert store.exists_many(["epd:kv:pool:nothing:00", io.key(HASHES[0])]) == [False, True]


def test_a_block_stored_with_other_metadata_is_a_miss(store, meta, make_cache):
    other = KVBlockMeta(meta.fingerprint, meta.block_size, "xxhash_cbor", 2)  # same key
    KVBlockIO(store, "pool", other).save(make_cache(), [1], HASHES[:1])
    io = KVBlockIO(store, "pool", meta)
    assert io.load(torch.zeros(make_cache().shape), [1], HASHES[:1]) == [False]
    assert (io.stats.loaded, io.stats.misses, io.stats.rejected) == (0, 0, 1)
    assert io.rejections.snapshot() == {"metadata": 1}


@pytest.mark.parametrize(
    "shape,dtype", [((8, 2, 2, 4, 2, 4), torch.float32), (None, torch.bfloat16)]
)
def test_a_block_of_another_head_size_or_dtype_is_a_miss(store, meta, make_cache, shape, dtype):
    io = KVBlockIO(store, "pool", meta)
    io.save(make_cache(), [1], HASHES[:1])
    assert io.load(torch.zeros(shape or make_cache().shape, dtype=dtype), [1], HASHES[:1]) == [
        False
    ]
    assert io.stats.rejected == 1 and io.rejections.snapshot() == {"dtype_shape": 1}
    assert store.exists_many([io.key(HASHES[0])]) == [False]  # a key names one geometry: gone


def test_garbage_bytes_are_a_miss(store, meta, make_cache):
    io = KVBlockIO(store, "pool", meta)
    assert store.put_many([(io.key(HASHES[0]), b"\x00garbage" * 100)]) == [True]
    dest = torch.zeros(make_cache().shape)
    assert io.load(dest, [1], HASHES[:1]) == [False]
    assert dest.count_nonzero() == 0 and io.stats.rejected == 1


def test_delete_removes_only_the_named_keys(store):
    store.put_many([("k1", b"1"), ("k2", b"2")])
    assert store.delete_many(["k1", "k3"]) == 1
    assert store.get_many(["k1", "k2"]) == [None, b"2"]
    assert store.stats.snapshot()["puts"] == 2


def test_empty_batches_are_no_ops(store):
    assert store.put_many([]) == [] and store.get_many([]) == [] and store.exists_many([]) == []
    assert store.delete_many([]) == 0


def test_a_put_replaces_the_previous_value(store):
    store.put_many([("k", b"old")])
    store.put_many([("k", b"new value")])
    assert store.get_many(["k"]) == [b"new value"]


def test_encoder_output_round_trips(store):
    io = EncoderOutputIO(store, "pool", "gemma3-tiny")
    embs = [torch.randn(4, 32).to(torch.bfloat16), torch.randn(9, 32).to(torch.bfloat16)]
    assert io.save([("img-a", embs[0]), ("img-b", embs[1])]) == [True, True]
    assert io.has(["img-a", "img-c"]) == [True, False]
    out = torch.empty(9, 32, dtype=torch.bfloat16)
    got = io.load(["img-a", "img-b", "img-c"], [(4, 32), (9, 32), (1, 32)], torch.bfloat16,
                  [None, out, None])  # fmt: skip
    assert torch.equal(got[0], embs[0]) and got[1] is out and torch.equal(out, embs[1])
    assert got[2] is None
    assert io.load(["img-a"], [(5, 32)], torch.bfloat16) == [None]
    assert io.rejections.snapshot() == {"dtype_shape": 1} and io.has(["img-a"]) == [False]


def _payloads(meta, n):
    """``n`` distinct valid encodings of one block, each filled with its writer's number."""
    key = "epd:kv:pool:fp:aa"
    return [encode_kv_block(torch.full((2, 2, 4, 2, 8), float(i)), meta, key) for i in range(n)]


def test_concurrent_writers_of_one_key_never_expose_a_torn_value_threads(store, meta):
    payloads, key, seen, stop = _payloads(meta, 4), "epd:kv:pool:fp:aa", [], threading.Event()

    def write(i):
        for _ in range(25):
            store.put_many([(key, payloads[i])])

    def read():
        while not stop.is_set():
            seen.extend(store.get_many([key]))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stop.set()
    reader.join(30)
    assert not any(t.is_alive() for t in [*threads, reader])
    assert {v for v in seen if v is not None} <= set(payloads)
    assert store.get_many([key])[0] in payloads
    assert store.stats.put_failures == 0


CHILD = """
import json, sys
from epdserve.connectors.storage.factory import create_store
config, key, payload = json.loads(sys.argv[1]), sys.argv[2], open(sys.argv[3], "rb").read()
store = create_store(config)
assert all(store.put_many([(key, payload)])[0] for _ in range(40)), store.stats
store.close()
"""


def test_concurrent_writers_of_one_key_never_expose_a_torn_value_processes(store, meta, tmp_path):
    payloads, key = _payloads(meta, 3), "epd:kv:pool:fp:bb"
    config = {"url": store.config.url} if hasattr(store.config, "url") else {"path": store.root}
    procs = []
    try:
        for i, payload in enumerate(payloads):
            (tmp_path / f"p{i}").write_bytes(payload)
            argv = [sys.executable, "-c", CHILD, json.dumps(config), key, str(tmp_path / f"p{i}")]
            procs.append(subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE))
        seen = []
        while any(p.poll() is None for p in procs):
            seen.extend(store.get_many([key]))
        errors = [p.communicate(timeout=30)[1].decode() for p in procs if p.returncode]
        assert not errors, errors
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert {v for v in seen if v is not None} <= set(payloads)
    assert store.get_many([key])[0] in payloads


def test_async_wrapper_runs_operations_in_order_and_returns_futures(store, meta, make_cache):
    source, dest = make_cache(), torch.zeros(make_cache().shape)
    io = KVBlockIO(store, "pool", meta)
    wrapper = AsyncBlockStore(store)
    try:
        saved = wrapper.submit(io.save, source, [1, 2], HASHES[:2])
        loaded = wrapper.submit(io.load, dest, [3, 4], HASHES[:2])
        assert saved.result(30) == [True, True] and loaded.result(30) == [True, True]
        assert torch.equal(dest[3:5], source[1:3])
        assert wrapper.put_many([("x", b"1")]).result(30) == [True]
        assert wrapper.get_many(["x", "y"]).result(30) == [b"1", None]
        assert wrapper.exists_many(["x"]).result(30) == [True]
        assert wrapper.delete_many(["x"]).result(30) == 1
    finally:
        wrapper.close(close_store=False)


@pytest.fixture(params=("redis", "shared_storage"))
def capped_store(request, make_store):
    """A store that holds about 1 MiB: files with a size cap, Redis with maxmemory + LRU."""
    if request.param == "shared_storage":
        yield make_store("shared_storage", max_bytes=1 << 20)
        return
    import redis

    store = make_store("redis")
    client = redis.Redis.from_url(store.config.url)
    used = client.info("memory")["used_memory"]
    try:
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.config_set("maxmemory", used + (1 << 20))
        yield store
    finally:
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", "noeviction")
        client.close()


def test_values_beyond_the_capacity_are_evicted_and_read_as_misses(capped_store):
    # Which values go is the backend's choice (Redis' LRU clock has 1 s resolution, so within
    # this test it is approximate); the exact file LRU order is tested in test_file_store.py.
    expected = {f"epd:kv:pool:fp:{i:04x}": bytes([i]) * 65536 for i in range(48)}
    items = list(expected.items())
    for start in range(0, 48, 4):
        assert capped_store.put_many(items[start : start + 4]) == [True] * 4
    values = dict(zip(expected, capped_store.get_many(list(expected)), strict=True))
    present = {k: v for k, v in values.items() if v is not None}
    assert 0 < len(present) < 24 and all(v == expected[k] for k, v in present.items())
    assert capped_store.stats.put_failures == 0 and capped_store.stats.get_failures == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kv_blocks_round_trip_through_a_device_cache(store, meta, make_cache):
    source = make_cache(torch.bfloat16).cuda()
    dest = torch.zeros_like(source)
    io = KVBlockIO(store, "pool", meta)
    assert io.save(source, [1, 2, 3], HASHES[:3]) == [True] * 3
    assert io.load(dest, [5, 6, 7], HASHES[:3]) == [True] * 3
    assert torch.equal(dest[5:8], source[1:4])
