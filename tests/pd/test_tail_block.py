"""A prompt's partial last block (its tail) moves from the prefill pod to the decode pod, so
the decode pod computes only the prompt's last token, as vLLM's P/D does; the tail is never a
block of the prefix cache or of a KV event. Exact scheduler + connector states over a real
shared directory, no model (the ``Pod`` of ``test_state_machine.py``)."""

from __future__ import annotations

import time

import pytest
import torch
from test_state_machine import BS, Pod, make_request

from epdserve.connectors.kv_connector import BlockTransfer
from epdserve.connectors.kv_connector.load_chain import tail_hash
from epdserve.connectors.kv_events import BlockStored


@pytest.fixture
def pods(tmp_path):
    made = []

    def make(role: str) -> Pod:
        made.append(Pod(tmp_path / "kv", role))
        return made[-1]

    yield make
    for pod in made:
        pod.close()


def prefill(pod: Pod, n_tokens: int) -> tuple[dict, list]:
    """Run a handed-over prompt of ``n_tokens`` on a prefill pod: its params and saves."""
    pod.cache.copy_(torch.randn(pod.cache.shape))  # what its forwards would have written
    req = make_request("p", n_tokens, max_tokens=1, params={"do_remote_decode": True})
    pod.sched.add_request(req)
    saves = []
    for _ in range(500):
        out, outputs = pod.step()
        saves += out.kv_connector_metadata.saves
        if outputs:
            return outputs[0].kv_transfer_params, saves
        time.sleep(0.005)  # its saves run on the worker side's thread
    raise AssertionError("the prefill never answered")


def decode(pod: Pod, n_tokens: int, params: dict | None, req_id: str = "d"):
    """A decode request for the same prompt: its first scheduled step and its loads."""
    req = make_request(req_id, n_tokens, params=params)
    pod.sched.add_request(req)
    loads = []
    for _ in range(500):
        out, _ = pod.step()
        loads += out.kv_connector_metadata.loads
        if out.num_scheduled_tokens:
            return req, out, loads
        time.sleep(0.005)  # its loads run on the worker side's thread
    raise AssertionError("the decode request was never scheduled")


def test_the_decode_pod_loads_the_tail_and_computes_only_the_last_token(pods):
    producer, consumer = pods("kv_producer"), pods("kv_consumer")
    params, saves = prefill(producer, 14)  # 3 full blocks of 4 and 2 tokens
    req = make_request("probe", 14)
    tail = tail_hash(req, BS)
    assert saves == [BlockTransfer("p", [1, 2, 3, 4], [*req.block_hashes[:3], tail], 2)]
    assert params["tail_hash"] == tail.hex() and params["num_tokens"] == 14
    stored = [e for e in producer.transfer.connector.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 3  # the full blocks only: a tail is no block of the prefix index

    got, out, loads = decode(consumer, 14, params)
    assert loads == [BlockTransfer("d", [1, 2, 3, 4], [*req.block_hashes[:3], tail], 2)]
    assert out.num_scheduled_tokens == {"d": 1}  # the prompt's last token, for the logits
    assert out.scheduled_new_reqs[0].num_computed_tokens == 13
    assert got.num_external_computed_tokens == 13 and consumer.sched.prompt_sources == [1, 0, 13]
    assert torch.equal(consumer.cache[1:4], producer.cache[1:4])
    assert torch.equal(consumer.cache[4, :, :, :2], producer.cache[4, :, :, :2])
    cached = [consumer.kv.pool.get_cached_block(h) for h in req.block_hashes[:3]]
    assert [b.block_id for b in cached] == [1, 2, 3]
    assert consumer.kv.pool.get_cached_block(tail) is None  # partial: not a cached block
    consumer.step_until(lambda *_: not consumer.sched.has_unfinished_requests())
    consumer.kv.pool.check_integrity()


def test_a_decode_pod_finds_the_tail_by_lookup_after_its_own_cached_blocks(pods):
    producer, consumer = pods("kv_producer"), pods("kv_consumer")
    prefill(producer, 14)
    decode(consumer, 8, None, "warm")  # its own cache now holds blocks 0 and 1 ...
    consumer.step_until(lambda *_: not consumer.sched.has_unfinished_requests())
    got, out, loads = decode(consumer, 14, None)  # ... then the whole prompt, no params
    req = make_request("probe", 14)
    assert [(t.block_hashes, t.tail_tokens) for t in loads] == [
        ([req.block_hashes[2], tail_hash(req, BS)], 2)
    ]
    assert out.num_scheduled_tokens == {"d": 1} and got.num_external_computed_tokens == 5
    assert out.scheduled_new_reqs[0].num_computed_tokens == 13


def test_a_prompt_ending_on_a_block_boundary_loads_its_last_block_but_one_token(pods):
    producer, consumer = pods("kv_producer"), pods("kv_consumer")
    params, saves = prefill(producer, 12)
    assert "tail_hash" not in params and all(t.tail_tokens == 0 for t in saves)
    got, out, loads = decode(consumer, 12, params)
    assert [len(t.block_ids) for t in loads] == [3] and loads[0].tail_tokens == 0
    assert out.num_scheduled_tokens == {"d": 1} and got.num_external_computed_tokens == 11


def test_a_missing_tail_is_recomputed_and_the_full_blocks_still_load(pods):
    producer, consumer = pods("kv_producer"), pods("kv_consumer")
    params, _ = prefill(producer, 14)
    req = make_request("probe", 14)
    tail = tail_hash(req, BS)
    assert producer.store.inner.delete_many([producer.io.key(tail)]) == 1
    got, out, _ = decode(consumer, 14, params)
    assert out.num_scheduled_tokens == {"d": 2} and got.num_external_computed_tokens == 12
    assert consumer.transfer.load_failures == 1
    assert consumer.kv.pool.get_cached_block(req.block_hashes[2]).block_id == 3


def test_another_adapter_or_salt_names_another_tail(pods):
    plain = make_request("a", 14)
    salted = make_request("b", 14)
    salted.cache_salt = "tenant"
    assert tail_hash(plain, BS) != tail_hash(salted, BS)
    assert tail_hash(make_request("c", 12), BS) is None  # no partial block
