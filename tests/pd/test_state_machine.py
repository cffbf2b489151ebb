"""Exact states of the scheduler + KV connector (real shared-storage store, no model).

The worker side runs for real on a random "KV cache"; a gate around the real store holds
loads or saves in flight so each state can be observed.
"""

from __future__ import annotations

import threading

import pytest
import torch

from epdserve.connectors.kv_connector import (
    BlockTransfer,
    KVConnectorRole,
    KVLayout,
    KVTransferConfig,
    SharedStorageConnector,
)
from epdserve.connectors.storage import (
    BlockStore,
    KVBlockIO,
    SharedStorageBlockStore,
    SharedStorageConfig,
)
from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, none_hash
from epdserve.engine.core.interfaces import ModelRunnerOutput
from epdserve.engine.core.kv_cache_manager import KVCacheManager
from epdserve.engine.core.request import Request, RequestStatus
from epdserve.engine.core.scheduler import Scheduler
from epdserve.engine.kv_transfer.coordinator import KVTransferCoordinator
from epdserve.engine.sampling_params import SamplingParams

BS, NUM_BLOCKS = 4, 16
LAYOUT = KVLayout("fp-test", BS, "sha256_cbor", 2)
CACHE_SHAPE = (NUM_BLOCKS, 2, 2, BS, 2, 8)


class GatedStore(BlockStore):
    """A real store whose reads and writes wait until their gate opens."""

    def __init__(self, inner: BlockStore):
        self.inner, self.stats = inner, inner.stats
        self.reads, self.writes, self.lookups = (threading.Event() for _ in range(3))
        for gate in (self.reads, self.writes, self.lookups):
            gate.set()

    def put_many(self, items):
        assert self.writes.wait(10)
        return self.inner.put_many(items)

    def get_many(self, keys):
        assert self.reads.wait(10)
        return self.inner.get_many(keys)

    def exists_many(self, keys):
        assert self.lookups.wait(10)
        return self.inner.exists_many(keys)

    def delete_many(self, keys):
        return self.inner.delete_many(keys)

    def close(self):
        self.inner.close()


class Pod:
    """Scheduler + both connector halves over one store; ``step`` plays the model runner."""

    def __init__(self, tmp_path, role="kv_both"):
        self.store = GatedStore(SharedStorageBlockStore(SharedStorageConfig(str(tmp_path))))
        config = KVTransferConfig("SharedStorageConnector", role, {"path": str(tmp_path)})
        conn = SharedStorageConnector(config, KVConnectorRole.SCHEDULER, LAYOUT, self.store)
        self.worker = SharedStorageConnector(config, KVConnectorRole.WORKER, LAYOUT, self.store)
        self.cache = torch.zeros(CACHE_SHAPE)
        self.worker.register_kv_caches(self.cache)
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.transfer = KVTransferCoordinator(conn, self.kv, config.is_consumer)
        self.sched = Scheduler(self.kv, 8, 64, 64, self.transfer)
        self.io = KVBlockIO(self.store.inner, "default", conn.kv_io.meta)

    def step(self, token=7):
        out = self.sched.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv()
        req_ids = list(out.num_scheduled_tokens)
        reqs = self.sched.requests
        sampled = [
            [token] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in req_ids
        ]
        self.worker.wait_for_save()
        kv_out = self.worker.take_output(set(out.finished_req_ids))
        result = ModelRunnerOutput(req_ids, sampled, kv_connector_output=kv_out)
        return out, self.sched.update_from_output(out, result)

    def step_until(self, done, limit=500):
        for _ in range(limit):
            out, outputs = self.step()
            if done(out, outputs):
                return out, outputs
            threading.Event().wait(0.005)
        raise AssertionError("condition never reached")

    def close(self):
        self.worker.close()


@pytest.fixture
def pod(tmp_path):
    p = Pod(tmp_path / "kv")
    yield p
    p.close()


def make_request(req_id, n_tokens, max_tokens=4, params=None, first=10):
    fn = get_hash_fn("sha256_cbor")
    return Request(
        req_id,
        list(range(first, first + n_tokens)),
        SamplingParams(max_tokens=max_tokens),
        2,
        BlockHasher(BS, fn, none_hash(fn, "s")),
        kv_transfer_params=params,
    )


def store_blocks(pod, request, indices):
    """What a prefill pod would have saved: random blocks under the request's hashes."""
    src = torch.randn(CACHE_SHAPE)
    ids = [i + 1 for i in indices]
    assert all(pod.io.save(src, ids, [request.block_hashes[i] for i in indices]))
    return src


def test_a_request_waits_for_remote_kvs_then_computes_only_the_rest(pod):
    req = make_request("a", 14)  # 3 loadable blocks + 2 tokens
    src = store_blocks(pod, req, [0, 1, 2])
    pod.store.reads.clear()
    pod.sched.add_request(req)
    out, outputs = pod.step_until(lambda o, _: o.kv_connector_metadata.loads)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {} and outputs == []
    assert out.kv_connector_metadata.loads == [BlockTransfer("a", [1, 2, 3], req.block_hashes[:3])]
    assert pod.kv.pool.get_cached_block(req.block_hashes[0]) is None  # not named until loaded
    assert pod.sched.num_waiting() == 1 and req.num_computed_tokens == 0
    out, _ = pod.step()  # the load is still in flight
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and out.num_scheduled_tokens == {}
    pod.store.reads.set()
    out, _ = pod.step_until(lambda o, _: o.num_scheduled_tokens)
    assert out.num_scheduled_tokens == {"a": 2}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert torch.equal(pod.cache[1:4], src[1:4])
    assert [pod.kv.pool.get_cached_block(h).block_id for h in req.block_hashes[:3]] == [1, 2, 3]
    assert (pod.transfer.hits, pod.transfer.load_failures, pod.transfer.queries) == (12, 0, 14)


def test_a_block_that_fails_to_load_is_recomputed_with_every_block_after_it(pod):
    req = make_request("a", 14)
    store_blocks(pod, req, [0, 1, 2])
    # the lookup sees 3 blocks, but block 1 turns out garbage: block 2 is useless without it
    pod.store.inner.put_many([(pod.io.key(req.block_hashes[1]), b"garbage")])
    pod.sched.add_request(req)
    out, _ = pod.step_until(lambda o, _: o.num_scheduled_tokens)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens == {"a": 10}
    assert (pod.transfer.hits, pod.transfer.load_failures) == (4, 2)
    assert out.scheduled_new_reqs[0].block_ids == [[1, 2, 3, 4]]


def test_a_finished_request_keeps_its_blocks_and_answer_until_its_save_completes(tmp_path):
    pod = Pod(tmp_path / "kv", role="kv_producer")
    try:
        pod.store.writes.clear()
        req = make_request("a", 9, max_tokens=1, params={"do_remote_decode": True})
        pod.sched.add_request(req)
        out, outputs = pod.step_until(lambda o, _: o.num_scheduled_tokens)
        assert out.kv_connector_metadata.saves == [BlockTransfer("a", [1, 2], req.block_hashes[:2])]
        assert outputs == [] and req.is_finished  # the answer waits for the save
        assert pod.kv.num_free_blocks() == NUM_BLOCKS - 1 - 3
        assert pod.sched.has_unfinished_requests()
        _, outputs = pod.step()
        assert outputs == [] and pod.kv.num_free_blocks() == NUM_BLOCKS - 1 - 3
        pod.store.writes.set()
        _, outputs = pod.step_until(lambda _, o: o)
        assert outputs[0].finish_reason == "length"
        assert outputs[0].kv_transfer_params["block_hashes"] == [
            h.hex() for h in req.block_hashes[:2]
        ]
        assert pod.kv.num_free_blocks() == NUM_BLOCKS - 1
        assert not pod.sched.has_unfinished_requests()
        assert pod.io.count_cached_prefix(req.block_hashes) == 2
        pod.kv.pool.check_integrity()
    finally:
        pod.close()


def test_a_request_aborted_while_loading_frees_its_blocks_after_the_load(pod):
    req = make_request("a", 14)
    store_blocks(pod, req, [0, 1, 2])
    pod.store.reads.clear()
    pod.sched.add_request(req)
    pod.step_until(lambda o, _: o.kv_connector_metadata.loads)
    pod.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert pod.kv.num_free_blocks() == NUM_BLOCKS - 1 - 3  # the load still writes into them
    assert pod.sched.has_unfinished_requests()
    pod.store.reads.set()
    pod.step_until(lambda *_: not pod.sched.has_unfinished_requests())
    assert pod.kv.num_free_blocks() == NUM_BLOCKS - 1
    pod.kv.pool.check_integrity()


def test_blocks_already_in_the_store_are_not_saved_again(pod):
    req = make_request("a", 14)
    store_blocks(pod, req, [0, 1])
    pod.store.reads.clear()  # keep the load in flight: the blocks are not yet computed here
    pod.sched.add_request(req)
    pod.store.reads.set()
    out, _ = pod.step_until(lambda o, _: o.num_scheduled_tokens)
    assert out.kv_connector_metadata.saves == [BlockTransfer("a", [3], req.block_hashes[2:3])]


def test_loaded_blocks_of_a_waiting_request_yield_when_nothing_else_can_run(pod):
    a, b = make_request("a", 30), make_request("b", 30, first=500)
    store_blocks(pod, a, range(7))
    store_blocks(pod, b, range(7))
    pod.sched.add_request(a)
    pod.sched.add_request(b)
    finished = []
    # 15 usable blocks: a (9 blocks once it has generated) cannot run while b keeps the 7
    # blocks its load filled, and nothing else is running to free any
    pod.step_until(
        lambda _, outs: finished.extend(o for o in outs if o.finish_reason) or len(finished) == 2
    )
    assert pod.kv.num_free_blocks() == NUM_BLOCKS - 1
    assert pod.transfer.load_failures == 0
    pod.kv.pool.check_integrity()


def test_a_slow_store_lookup_never_stalls_running_requests(pod):
    running = make_request("r", 6, max_tokens=8, first=900)
    pod.sched.add_request(running)
    pod.step_until(lambda o, _: o.num_scheduled_tokens)
    req = make_request("a", 14)
    store_blocks(pod, req, [0, 1, 2])
    pod.store.lookups.clear()  # the store stops answering lookups
    pod.sched.add_request(req)
    for _ in range(3):
        out, _ = pod.step()
        assert out.num_scheduled_tokens == {"r": 1}  # decoding goes on meanwhile
        assert req.status == RequestStatus.WAITING and pod.sched.num_waiting() == 1
    pod.store.lookups.set()
    out, _ = pod.step_until(lambda o, _: "a" in o.num_scheduled_tokens)
    assert out.num_scheduled_tokens["a"] == 2 and req.num_external_computed_tokens == 12


@pytest.mark.parametrize("fingerprint, failures", [(LAYOUT.fingerprint, 3), ("another-model", 0)])
def test_handed_over_blocks_are_trusted_only_from_the_same_model(pod, fingerprint, failures):
    probe = make_request("probe", 14)
    params = {
        "do_remote_prefill": True,
        "block_hashes": [h.hex() for h in probe.block_hashes],
        "fingerprint": fingerprint,
        "pool": "default",
    }
    req = make_request("a", 14, params=params)  # nothing was stored after all
    pod.sched.add_request(req)
    out, _ = pod.step_until(lambda o, _: o.num_scheduled_tokens)
    # trusted: the load is tried, fails, and everything is recomputed; else: a plain miss
    assert out.num_scheduled_tokens == {"a": 14}
    assert (pod.transfer.load_failures, pod.transfer.hits) == (failures, 0)
