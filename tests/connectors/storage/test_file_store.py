"""Shared-storage backend specifics: LRU eviction, read-only volumes, corrupt files."""

from __future__ import annotations

import os
import shutil
import time

import torch

from epdserve.connectors.storage import KVBlockIO

V = 100_000


def test_eviction_removes_the_least_recently_used_files(make_store):
    store = make_store("shared_storage", max_bytes=10 * V, evict_to=0.5, touch_interval_s=0)
    keys = [f"k{i}" for i in range(11)]
    store.put_many([(k, b"x" * V) for k in keys[:10]])
    now = time.time()
    for i, key in enumerate(keys[:10]):
        os.utime(store.path_of(key), (now - 100 + i, now - 100 + i))
    assert store.get_many(["k0"]) == [b"x" * V]  # a read makes k0 the most recent
    store.put_many([("k10", b"x" * V)])
    present = [k for k, ok in zip(keys, store.exists_many(keys), strict=True) if ok]
    assert present == ["k0", "k7", "k8", "k9", "k10"]
    assert store.stats.evictions == 6


def test_files_are_fanned_out_and_temp_files_do_not_linger(make_store):
    store = make_store("shared_storage")
    store.put_many([(f"key{i}", b"v") for i in range(20)])
    subdirs = [d for d in os.listdir(store.root) if os.path.isdir(os.path.join(store.root, d))]
    assert len(subdirs) > 1 and all(len(d) == 2 for d in subdirs)
    names = [n for d in subdirs for n in os.listdir(os.path.join(store.root, d))]
    assert len(names) == 20 and not [n for n in names if n.endswith(".tmp")]


def test_stale_temp_files_are_cleaned_by_the_usage_scan(make_store):
    store = make_store("shared_storage", max_bytes=1 << 20)
    stale = os.path.join(store.root, "ab", ".abc.epd.1.0.tmp")
    os.makedirs(os.path.dirname(stale))
    with open(stale, "wb") as f:
        f.write(b"partial")
    os.utime(stale, (0, 0))
    store.put_many([("k", b"v")])
    assert not os.path.exists(stale)


def test_a_corrupted_file_is_a_miss(make_store, meta, make_cache):
    store = make_store("shared_storage")
    io = KVBlockIO(store, "pool", meta)
    io.save(make_cache(), [1, 2], [b"\x01", b"\x02"])
    with open(store.path_of(io.key(b"\x01")), "r+b") as f:
        f.truncate(100)
    with open(store.path_of(io.key(b"\x02")), "r+b") as f:
        f.write(b"\xff" * 16)
    assert io.load(torch.zeros(make_cache().shape), [1, 2], [b"\x01", b"\x02"]) == [False, False]
    assert io.stats.rejected == 2


def test_an_unreadable_entry_is_a_counted_miss(make_store):
    store = make_store("shared_storage")
    os.makedirs(store.path_of("k"))  # a directory where the value file should be
    assert store.get_many(["k"]) == [None]
    assert store.stats.get_failures == 1


def test_a_read_only_volume_fails_puts_softly_and_still_serves_gets(make_store, read_only):
    store = make_store("shared_storage", max_bytes=1 << 20)
    store.put_many([("old", b"value")])
    undo = read_only(store.root)
    try:
        assert store.put_many([("new", b"v"), ("old", b"other")]) == [False, False]
        assert store.get_many(["old", "new"]) == [b"value", None]
        assert store.stats.put_failures == 2 and store.stats.get_failures == 0
        reopened = type(store)(store.config)  # a pod starting on the read-only volume
        assert reopened.get_many(["old"]) == [b"value"]
        assert reopened.put_many([("x", b"y")]) == [False]
    finally:
        undo()
    assert store.put_many([("new", b"v")]) == [True]


def test_a_wiped_volume_is_recreated_on_the_next_put(make_store):
    store = make_store("shared_storage")
    store.put_many([("k", b"1")])
    shutil.rmtree(store.root)
    assert store.get_many(["k"]) == [None]
    assert store.put_many([("k", b"2")]) == [True] and store.get_many(["k"]) == [b"2"]
