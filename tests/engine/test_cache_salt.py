"""cache_salt: folded into block 0's hash, so salted prompts share blocks only within a salt."""

from __future__ import annotations

import pytest

from epdserve.engine.core.block_pool import BlockStored
from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, hash_block, none_hash
from epdserve.engine.core.interfaces import ModelRunnerOutput
from epdserve.engine.core.kv_cache_manager import KVCacheManager
from epdserve.engine.core.request import Request
from epdserve.engine.core.scheduler import Scheduler
from epdserve.engine.sampling_params import SamplingParams

BS = 4
FN = get_hash_fn("sha256_cbor")
ROOT = none_hash(FN, "s")
TOKENS = list(range(10, 23))  # 3 full blocks and one token


def hashes(tokens=TOKENS, salt=None, mm_spans=()):
    out: list[bytes] = []
    BlockHasher(BS, FN, ROOT).extend(out, tokens, mm_spans, salt)
    return out


def request(req_id, salt=None, tokens=TOKENS, max_tokens=1):
    params = SamplingParams(max_tokens=max_tokens)
    return Request(req_id, tokens, params, 2, BlockHasher(BS, FN, ROOT), cache_salt=salt)


def test_unsalted_hashes_are_the_plain_chain():
    expected, parent = [], ROOT
    for i in range(3):
        parent = hash_block(FN, parent, TOKENS[i * BS : (i + 1) * BS], None)
        expected.append(parent)
    assert hashes() == expected
    assert request("r", salt="").block_hashes == expected  # an empty salt is no salt


def test_the_salt_is_an_extra_key_of_block_zero_only():
    hasher = BlockHasher(BS, FN, ROOT)
    assert hasher.block_extra_keys(0, (), "tenant-a") == ("tenant-a",)
    assert hasher.block_extra_keys(1, (), "tenant-a") is None
    h0 = hash_block(FN, ROOT, TOKENS[:BS], ("tenant-a",))
    assert hashes(salt="tenant-a")[:2] == [h0, hash_block(FN, h0, TOKENS[BS : 2 * BS], None)]


def test_every_block_differs_between_salts_and_from_no_salt():
    plain, a, b = hashes(), hashes(salt="a"), hashes(salt="b")
    for i in range(3):
        assert len({plain[i], a[i], b[i]}) == 3, f"block {i}"
    assert hashes(salt="a") == a  # deterministic


def test_the_salt_follows_the_images_overlapping_block_zero():
    spans = ((1, 3, "img0"),)
    assert BlockHasher(BS, FN, ROOT).block_extra_keys(0, spans, "a") == ("img0", "a")
    assert hashes(salt="a", mm_spans=spans) != hashes(mm_spans=spans)


def test_decode_blocks_of_a_salted_request_chain_from_the_salted_prompt():
    r = request("r", salt="a", max_tokens=8)
    r.append_output_token_ids([5, 6, 7])  # fills block 3
    assert len(r.block_hashes) == 4
    assert r.block_hashes[3] == hash_block(FN, r.block_hashes[2], TOKENS[12:] + [5, 6, 7], None)


def test_block_extra_keys_are_none_for_a_plain_request():
    assert request("r").block_extra_keys(0, 3) is None
    assert request("r", salt="a").block_extra_keys(0, 3) == [("a",), None, None]


# --- the scheduler's prefix cache --------------------------------------------------------


def run_to_end(sched: Scheduler, req: Request) -> int:
    """Run ``req`` (one sampled token) to completion; its prefix-cache hit in tokens."""
    sched.add_request(req)
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(ids, [[7] for _ in ids]))
    assert req.is_finished
    return req.num_cached_tokens


@pytest.fixture
def sched():
    return Scheduler(KVCacheManager(20, BS, enable_caching=True), 8, 64, 64)


def test_a_prompt_hits_the_blocks_of_an_earlier_request_with_the_same_salt(sched):
    assert run_to_end(sched, request("a1", salt="a")) == 0
    assert run_to_end(sched, request("a2", salt="a")) == 12


def test_a_prompt_hits_nothing_cached_under_another_salt(sched):
    run_to_end(sched, request("a", salt="a"))
    assert run_to_end(sched, request("b", salt="b")) == 0
    assert run_to_end(sched, request("plain")) == 0


def test_unsalted_prompts_still_share_blocks(sched):
    run_to_end(sched, request("p1"))
    assert run_to_end(sched, request("p2")) == 12


# --- KV events ---------------------------------------------------------------------------


def test_a_salted_prompts_events_carry_router_keys_instead_of_tokens_and_salt():
    from epdserve.connectors.kv_events.keys import request_keys

    kv = KVCacheManager(20, BS, enable_caching=True, enable_events=True)
    sched = Scheduler(kv, 8, 64, 64)
    run_to_end(sched, request("a", salt="tenant-a"))
    plain = [50 + t for t in TOKENS]
    run_to_end(sched, request("p", tokens=plain))
    salted, unsalted = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert salted.token_ids == [] and salted.parent_block_hash is None
    assert salted.router_keys == request_keys(TOKENS, BS, cache_salt="tenant-a")
    assert unsalted.router_keys is None and unsalted.token_ids == plain[:12]
    assert unsalted.extra_keys == [None, None, None]


def test_on_the_wire_a_salted_event_holds_neither_tokens_nor_the_salt():
    from epdserve.connectors.kv_events import EventBatch, EventDecoder, EventEncoder
    from epdserve.connectors.kv_events.schema import to_wire_event

    kv = KVCacheManager(20, BS, enable_caching=True, enable_events=True)
    run_to_end(Scheduler(kv, 8, 64, 64), request("a", salt="tenant-a"))
    payload = EventEncoder().encode(
        EventBatch(0.0, [to_wire_event(e) for e in kv.take_events()], 0)
    )
    assert b"tenant-a" not in payload
    (event,) = EventDecoder().decode(payload).events
    assert event.token_ids == [] and event.extra_keys is None and len(event.router_keys) == 3
