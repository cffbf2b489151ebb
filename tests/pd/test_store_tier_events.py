"""Store-tier KV events: a prefill pod's saves to the shared store are announced with
``medium="STORE"``, so the router indexes the prompt in both tiers for that pod."""

from __future__ import annotations

import threading

import pytest
import torch
from pd_support import engine_core, prompts

from epdserve.connectors.kv_connector import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVLayout,
    KVTransferConfig,
    ScheduledRequest,
    SharedStorageConnector,
)
from epdserve.connectors.kv_events import BlockRemoved, EventBatch, hash_to_int, to_wire_event
from epdserve.engine.core.engine_core import EngineCoreRequest
from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, none_hash
from epdserve.engine.core.request import Request
from epdserve.engine.sampling_params import SamplingParams
from epdserve.router.index import LOCAL, STORE, PrefixIndex
from epdserve.router.keys import request_keys


def test_saved_blocks_are_indexed_in_the_store_tier(models, tmp_path):
    engine = engine_core(models.get("llama"), "prefill", tmp_path, enable_kv_events=True)
    prompt = prompts(3, lengths=(100,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(EngineCoreRequest("r", prompt, params))
    index, events = PrefixIndex(), []
    for _ in range(3000):  # until the request ends and its saves have landed
        engine.step()
        events += engine.take_events()
        if not engine.has_unfinished_requests() and any(
            getattr(e, "medium", None) == "STORE" for e in events
        ):
            break
    index.apply("prefill-0", EventBatch(0.0, [to_wire_event(e) for e in events], 0))
    keys = request_keys(prompt, engine.kv.block_size)
    local, loadable = index.match_tiers(keys, ["prefill-0"])["prefill-0"]
    assert local == len(keys) and loadable == len(keys)
    assert index.pod_block_count("prefill-0", STORE) == len(keys)
    assert index.pod_block_count("prefill-0", LOCAL) == len(keys)
    assert index.match_tiers(keys, ["decode-0"])["decode-0"] == (0, len(keys))
    engine.close()


BS = 4
LAYOUT = KVLayout("fp-test", BS, "sha256_cbor", 2)
CACHE_SHAPE = (8, 2, 2, BS, 2, 8)


@pytest.fixture
def halves(tmp_path):
    """The scheduler side and the worker side of one connector over a shared directory."""
    config = KVTransferConfig("SharedStorageConnector", "kv_both", {"path": str(tmp_path)})
    sched = SharedStorageConnector(config, KVConnectorRole.SCHEDULER, LAYOUT)
    worker = SharedStorageConnector(config, KVConnectorRole.WORKER, LAYOUT)
    worker.register_kv_caches(torch.randn(CACHE_SHAPE))
    yield sched, worker
    sched.close()
    worker.close()


def request(req_id: str, n_tokens: int) -> Request:
    fn = get_hash_fn("sha256_cbor")
    tokens = list(range(10, 10 + n_tokens))
    return Request(req_id, tokens, SamplingParams(), 2, BlockHasher(BS, fn, none_hash(fn, "s")))


def report_until(sched, worker, done, finished=frozenset()) -> None:
    """Hand every worker output to the scheduler side until ``done(output)``."""
    for _ in range(2000):
        out = worker.take_output(set(finished))
        sched.update_connector_output(out)
        if done(out):
            return
        threading.Event().wait(0.005)
    raise AssertionError("the worker never reported the transfer")


def test_saves_become_store_events_of_the_scheduler_side_once_reported(halves):
    sched, worker = halves
    req = request("a", 9)  # two full blocks and one token
    meta = sched.build_connector_meta([ScheduledRequest(req, [3, 5, 7], 9)])
    assert meta.saves == [BlockTransfer("a", [3, 5], req.block_hashes[:2])]
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    assert sched.take_events() == []  # nothing reported yet
    report_until(sched, worker, lambda out: out.finished_sending == ["a"], {"a"})
    events = sched.take_events()
    first, second = (hash_to_int(h) for h in req.block_hashes[:2])
    assert [(e.block_hashes, e.parent_block_hash, e.medium) for e in events] == [
        ([first], None, "STORE"),
        ([second], first, "STORE"),
    ]
    assert [e.token_ids for e in events] == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert sched.take_events() == []  # taken once
    assert worker.stats() == KVConnectorStats(saved=2)
    assert sched.stats() == KVConnectorStats()


def test_a_load_that_finds_blocks_gone_becomes_removed_events(halves):
    sched, worker = halves
    req = request("b", 9)
    worker.bind_connector_metadata(
        KVConnectorMetadata(loads=[BlockTransfer("b", [1, 2], req.block_hashes[:2])])
    )
    worker.start_load_kv()
    report_until(sched, worker, lambda out: out.finished_recving == ["b"])
    events = sched.take_events()
    assert [(type(e), e.block_hashes, e.medium) for e in events] == [
        (BlockRemoved, [hash_to_int(h)], "STORE") for h in req.block_hashes[:2]
    ]
    assert worker.stats() == KVConnectorStats(misses=2)
    assert worker.get_block_ids_with_load_errors() == set()  # reported with the output
