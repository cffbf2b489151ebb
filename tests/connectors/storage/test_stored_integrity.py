"""Conformance: a stored KV block that was damaged in the store (a bit flipped in Redis or on
disk, cut, padded, swapped with another, crafted) is a miss on every backend: the slot is
left alone, the value is deleted, and the refusal is counted by reason."""

from __future__ import annotations

import pytest
import torch

from epdserve.connectors.storage import KVBlockIO, KVBlockMeta, encode_kv_block
from epdserve.connectors.storage.transfer import rejection_counts

HASHES = [bytes([i]) * 32 for i in range(1, 5)]
SOURCE_IDS, DEST_IDS = [1, 2, 3, 4], [7, 6, 5, 4]


def nested(depth: int) -> bytes:
    raw = b"[" * depth + b"]" * depth
    return len(raw).to_bytes(8, "little") + raw + bytes(2048)


def flip_data_bit(raw, keys):
    raw.flip_bit(keys[1], -1)
    return {1: "checksum"}


def flip_header_bit(raw, keys):
    raw.flip_bit(keys[0], 10)  # inside "__metadata__": the header names no metadata
    return {0: "not_safetensors"}


def truncate(raw, keys):
    raw.truncate(keys[2], len(raw.get(keys[2])) - 1)
    raw.truncate(keys[3], 100)  # inside the header
    return {2: "truncated", 3: "not_safetensors"}


def pad(raw, keys):
    raw.set(keys[1], raw.get(keys[1]) + bytes(1 << 20))
    return {1: "oversized"}


def swap(raw, keys):
    first, second = raw.get(keys[0]), raw.get(keys[3])
    raw.set(keys[0], second)
    raw.set(keys[3], first)
    return {0: "key", 3: "key"}


def copy_under_another_key(raw, keys):
    raw.set(keys[2], raw.get(keys[1]))  # same model, shape and checksum: only the key differs
    return {2: "key"}


def nest_10000(raw, keys):
    raw.set(keys[0], nested(10_000))  # longer than any header may be
    raw.set(keys[1], nested(8_000))  # fits: refused for its depth, before json sees it
    return {0: "header_too_large", 1: "too_deep"}


def not_safetensors(raw, keys):
    raw.set(keys[3], b"hello")
    return {3: "not_safetensors"}


def older_format(raw, keys):
    meta = KVBlockMeta("tiny-llama-0123", 4, "sha256_cbor", version=1)
    raw.set(keys[1], encode_kv_block(torch.zeros(2, 2, 4, 2, 8), meta, keys[1]))
    return {1: "format"}


DAMAGE = [
    flip_data_bit,
    flip_header_bit,
    truncate,
    pad,
    swap,
    copy_under_another_key,
    nest_10000,
    not_safetensors,
    older_format,
]


# staged: the host-staging path a device cache takes, run on CPU
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
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
