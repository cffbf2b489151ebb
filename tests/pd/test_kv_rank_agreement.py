"""The worker halves of a TP 2 pod agree on every transfer before reporting it: a block one
rank failed to save is not stored, a block one rank failed to load is invalid for both, and a
transfer is done only once it is done on both ranks. Two real worker halves over one shared
directory, one per thread, summing through a thread barrier as the TP group's all-reduce does.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from epdserve.connectors.kv_connector import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorRole,
    KVLayout,
    KVShard,
    KVTransferConfig,
    SharedStorageConnector,
)
from epdserve.connectors.storage import SharedStorageBlockStore, SharedStorageConfig
from epdserve.engine.executor.connector_halves import kv_head_slice

BS = 4
LAYOUT = KVLayout("fp-agree", BS, "sha256_cbor", 2)
RANK_CACHE = (8, 2, 2, BS, 1, 8)  # one of the model's 2 KV heads per rank
HASHES = [bytes([i]) * 32 for i in range(1, 4)]
IDS = [1, 2, 3]


class ThreadGroup:
    """``all_reduce`` for ``size`` threads: each adds its tensor, all get the sum."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=10)
        self.parts: dict[int, torch.Tensor] = {}
        self.calls = 0

    def all_reduce_for(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts.values())
            self.barrier.wait()
            self.calls += rank == 0
            t.copy_(total)
            return t

        return all_reduce


class Gated(SharedStorageBlockStore):
    """A shared-directory store whose puts can fail, and whose gets wait on a gate."""

    def __init__(self, path):
        super().__init__(SharedStorageConfig(path))
        self.refuse_puts = False
        self.reads = threading.Event()
        self.reads.set()

    def put_many(self, items):
        return [False] * len(items) if self.refuse_puts else super().put_many(items)

    def get_many(self, keys):
        assert self.reads.wait(10)
        return super().get_many(keys)


@pytest.fixture
def ranks(tmp_path):
    """``(workers, stores, group)`` of a TP 2 pod's two worker halves."""
    group = ThreadGroup(2)
    config = KVTransferConfig("SharedStorageConnector", "kv_both", {"path": str(tmp_path)})
    stores, workers = [], []
    for rank in (0, 1):
        store = Gated(str(tmp_path))
        shard = KVShard(kv_head_slice(2, rank, 2), group.all_reduce_for(rank))
        worker = SharedStorageConnector(config, KVConnectorRole.WORKER, LAYOUT, store, shard)
        worker.register_kv_caches(torch.randn(RANK_CACHE))
        stores.append(store)
        workers.append(worker)
    yield workers, stores, group
    for w in workers:
        w.close()


def step(workers, meta: KVConnectorMetadata, finished=frozenset()) -> list:
    """One step on both ranks at once: bind, start loads, hand saves over, report."""

    def run(worker):
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        worker.wait_for_save()
        return worker.take_output(set(finished))

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, workers))


def until(workers, done, finished=frozenset()) -> list:
    for _ in range(2000):
        outs = step(workers, KVConnectorMetadata(), finished)
        assert outs[0] == outs[1], "the ranks disagree"
        if done(outs[0]):
            return outs
        threading.Event().wait(0.005)
    raise AssertionError("the ranks never reported the transfer")


def test_a_block_one_rank_failed_to_save_is_reported_unsaved_by_both(ranks):
    workers, stores, _ = ranks
    stores[1].refuse_puts = True  # rank 1's heads never reach the store
    step(workers, KVConnectorMetadata(saves=[BlockTransfer("a", IDS, HASHES)]))
    outs = until(workers, lambda out: out.finished_sending == ["a"], {"a"})
    assert outs[0].saved == [(h, False) for h in HASHES]
    assert workers[0].stats().save_failures == 3 and workers[0].stats().saved == 0
    assert workers[0].kv_io.count_cached_prefix(HASHES) == 0  # rank 0's heads alone: no block


def test_saves_of_both_ranks_make_stored_blocks(ranks):
    workers, _, _ = ranks
    step(workers, KVConnectorMetadata(saves=[BlockTransfer("a", IDS, HASHES)]))
    outs = until(workers, lambda out: out.finished_sending == ["a"], {"a"})
    assert outs[0].saved == [(h, True) for h in HASHES]
    assert workers[1].kv_io.count_cached_prefix(HASHES) == 3


def test_a_block_one_rank_failed_to_load_is_invalid_on_both(ranks, tmp_path):
    workers, stores, _ = ranks
    cache = torch.randn(RANK_CACHE)
    workers[0].kv_io.save(cache, IDS, HASHES)  # head 0 of every block
    workers[1].kv_io.save(cache, IDS[:1], HASHES[:1])  # head 1 of the first only ...
    stores[1].put_many([(workers[1].kv_io.key(HASHES[2]), b"garbage")])  # ... and garbage
    outs = step(workers, KVConnectorMetadata(loads=[BlockTransfer("b", [4, 5, 6], HASHES)]))
    outs = until(workers, lambda out: out.finished_recving == ["b"])
    assert outs[0].invalid_block_ids == [5, 6]  # rank 0 loaded them, rank 1 could not
    assert outs[0].missed == HASHES[1:]  # gone from the store as whole blocks
    assert workers[0].stats().loaded == 1 and workers[0].stats().misses == 2
    # the output rank reports the value rank 1 refused (and deleted)
    assert workers[0].rejections() == {"not_safetensors": 1} == workers[1].rejections()
    assert workers[0].kv_io.rejections.snapshot() == {}  # rank 0 itself refused nothing


def test_a_load_is_done_only_when_every_rank_is_done(ranks):
    workers, stores, group = ranks
    cache = torch.randn(RANK_CACHE)
    for w in workers:
        w.kv_io.save(cache, IDS, HASHES)
    stores[1].reads.clear()  # rank 1's load is held in flight
    outs = step(workers, KVConnectorMetadata(loads=[BlockTransfer("c", [4, 5, 6], HASHES)]))
    for _ in range(5):
        threading.Event().wait(0.01)
        outs = step(workers, KVConnectorMetadata())
        assert outs[0] == outs[1] and outs[0].finished_recving == []
    calls = group.calls
    stores[1].reads.set()
    outs = until(workers, lambda out: out.finished_recving == ["c"])
    assert outs[0].invalid_block_ids == [] and group.calls > calls
    calls = group.calls
    step(workers, KVConnectorMetadata())  # nothing in flight: no collective
    assert group.calls == calls
