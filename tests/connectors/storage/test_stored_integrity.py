"""Conformance: a stored KV block that was damaged in the store (a bit flipped in Redis or on
disk, cut, padded, swapped with another, crafted) is a miss on every backend: the slot is
left alone, the value is deleted, and the refusal is counted by reason."""

from __future__ import annotations

import pytest
import torch
from raw_values import KV_DAMAGE

from epdserve.connectors.storage import KVBlockIO
from epdserve.connectors.storage.transfer import rejection_counts

HASHES = [bytes([i]) * 32 for i in range(1, 5)]
SOURCE_IDS, DEST_IDS = [1, 2, 3, 4], [7, 6, 5, 4]


# staged: the host-staging path a device cache takes, run on CPU
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("damage", KV_DAMAGE, ids=[d.__name__ for d in KV_DAMAGE])
def test_a_damaged_block_is_a_miss_deleted_and_counted(
    store, raw, meta, make_cache, damage, staged
):
    source = make_cache()
    KVBlockIO(store, "pool", meta).save(source, SOURCE_IDS, HASHES)
    io = KVBlockIO(store, "pool", meta, staging=staged)
    keys = [io.key(h) for h in HASHES]
    bad = damage(raw, keys)
    dest = torch.zeros(source.shape)
    loaded = io.load(dest, DEST_IDS, HASHES)
    assert loaded == [i not in bad for i in range(4)]
    for i, (src, dst) in enumerate(zip(SOURCE_IDS, DEST_IDS, strict=True)):
        expected = torch.zeros(source.shape[1:]) if i in bad else source[src]
        assert torch.equal(dest[dst], expected)  # a refused block never reaches its slot
    assert [raw.exists(k) for k in keys] == [i not in bad for i in range(4)]
    counts: dict[str, int] = {}
    for reason in bad.values():
        counts[reason] = counts.get(reason, 0) + 1
    assert io.rejections.snapshot() == counts
    assert (io.stats.loaded, io.stats.rejected, io.stats.misses) == (4 - len(bad), len(bad), 0)
    assert io.load(dest, DEST_IDS, HASHES) == loaded  # again: plain misses, counted once
    assert io.rejections.snapshot() == counts and io.stats.misses == len(bad)


@pytest.mark.parametrize("backend", ["redis", "shared_storage"])
def test_a_value_over_the_size_limit_is_refused_by_the_store_and_deleted(
    backend, make_store, meta, make_cache
):
    store = make_store(backend, max_value_bytes=4096)
    io = KVBlockIO(store, "pool", meta)
    assert io.save(make_cache(), [1, 2], HASHES[:2]) == [True, True]  # 2 KiB blocks
    key = io.key(HASHES[0])
    assert store.put_many([(key, bytes(8192))]) == [backend == "redis"]
    if backend == "shared_storage":  # the file store never writes one; a hostile writer may
        with open(store.path_of(key), "wb") as f:
            f.write(bytes(8192))
    assert io.load(torch.zeros(make_cache().shape), [1, 2], HASHES[:2]) == [False, True]
    assert store.stats.rejected == 1 and store.exists_many([key]) == [False]
    assert rejection_counts(io, store) == {"store_refused": 1}
