"""Exact-state tests of the block pool and KV cache manager (block ids, refs, eviction order)."""

from __future__ import annotations

import pytest
from conftest_helpers import make_kv_request

from epdserve.connectors.kv_events import hash_to_int
from epdserve.engine.core.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from epdserve.engine.core.kv_cache_manager import KVCacheManager

BS = 4


def make_request(req_id: str, tokens: list[int], seed: str = "s", algo: str = "sha256_cbor"):
    return make_kv_request(req_id, tokens, BS, seed, algo)


def test_null_block_is_taken_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_free_queue_is_lru_and_free_appends_in_given_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks([blocks[2], blocks[0], blocks[4]])
    assert pool.free_queue.block_ids() == [3, 1, 5]
    pool.check_integrity()


def test_touch_takes_a_free_block_out_of_the_queue():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([a, b])
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.free_queue.block_ids() == [1]
    pool.check_integrity()


def test_identical_prompts_share_cached_blocks_and_ref_counts():
    kv = KVCacheManager(10, BS)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    r1 = make_request("a", tokens)
    assert kv.get_computed_blocks(r1) == (([],), 0)
    kv.allocate_slots(r1, 10)
    assert kv.get_block_ids("a") == [1, 2, 3]
    r2 = make_request("b", tokens)
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits[0]] == [1, 2] and n == 8
    kv.allocate_slots(r2, 2, n, hits)
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kv.prefix_queries == 20 and kv.prefix_hits == 8


def test_cache_hit_never_covers_the_last_prompt_token():
    kv = KVCacheManager(10, BS)
    tokens = list(range(8))  # exactly two blocks
    kv.allocate_slots(make_request("a", tokens), 8)
    hits, n = kv.get_computed_blocks(make_request("b", tokens))
    assert n == 4 and len(hits[0]) == 1


def test_free_releases_tail_first_so_prefix_is_evicted_last():
    kv = KVCacheManager(10, BS)
    r = make_request("a", list(range(12)))
    kv.allocate_slots(r, 12)
    kv.free(r)
    assert kv.pool.free_queue.block_ids()[-3:] == [3, 2, 1]
    kv.pool.check_integrity()


def test_eviction_is_lazy_and_emits_block_removed():
    kv = KVCacheManager(4, BS, enable_events=True)  # 3 usable blocks
    r = make_request("a", list(range(8)))
    kv.allocate_slots(r, 8)
    stored = kv.take_events()
    assert isinstance(stored[0], BlockStored) and len(stored[0].block_hashes) == 2
    assert stored[0].parent_block_hash is None and stored[0].token_ids == list(range(8))
    kv.free(r)
    assert kv.pool.get_cached_block(r.block_hashes[0]) is not None  # still cached while free
    r2 = make_request("b", list(range(100, 112)))
    kv.allocate_slots(r2, 12)  # needs all 3 blocks: evicts both cached ones
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in removed] == [r.block_hashes[1], r.block_hashes[0]]
    assert kv.pool.get_cached_block(r.block_hashes[0]) is None


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(4, BS)
    assert kv.allocate_slots(make_request("a", list(range(16))), 16) is None
    assert kv.num_free_blocks() == 3 and kv.get_block_ids("a") == []


def test_reset_prefix_cache_refused_while_blocks_are_used_then_clears():
    kv = KVCacheManager(6, BS, enable_events=True)
    r = make_request("a", list(range(8)))
    kv.allocate_slots(r, 8)
    assert kv.reset_prefix_cache() is False
    kv.free(r)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached == {} and isinstance(kv.take_events()[-1], AllBlocksCleared)


def test_usage_counts_used_blocks_without_the_null_block():
    kv = KVCacheManager(5, BS)
    kv.allocate_slots(make_request("a", list(range(8))), 8)
    assert kv.usage == pytest.approx(0.5)


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor", "blake3_cbor"])
def test_hash_chain_depends_on_seed_parent_and_tokens(algo):
    a = make_request("a", list(range(8)), seed="x", algo=algo)
    b = make_request("b", list(range(8)), seed="x", algo=algo)
    c = make_request("c", list(range(8)), seed="y", algo=algo)
    d = make_request("d", [99, 1, 2, 3, 4, 5, 6, 7], seed="x", algo=algo)
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
    assert a.block_hashes[0] != c.block_hashes[0]
    assert a.block_hashes[1] != d.block_hashes[1]  # same tokens, different parent
    assert 0 <= hash_to_int(a.block_hashes[0]) < 2**64


def test_sha256_cbor_matches_a_hand_computed_chain():
    import hashlib

    import cbor2

    root = hashlib.sha256(cbor2.dumps("seed", canonical=True)).digest()
    h0 = hashlib.sha256(cbor2.dumps((root, (1, 2, 3, 4), None), canonical=True)).digest()
    assert make_request("a", [1, 2, 3, 4], seed="seed").block_hashes == [h0]


def test_output_tokens_extend_the_hash_list_when_a_block_fills():
    r = make_request("a", list(range(6)))
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([7])
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([8])
    assert len(r.block_hashes) == 2


def test_blocks_stored_after_a_prefix_hit_chain_from_the_last_hit_block():
    kv = KVCacheManager(10, BS, enable_events=True)
    first = make_request("a", list(range(9)))  # two full blocks cached
    kv.allocate_slots(first, 9)
    kv.take_events()
    second = make_request("b", list(range(13)))  # same two blocks, then a third
    hits, n = kv.get_computed_blocks(second)
    kv.allocate_slots(second, 13 - n, n, hits)
    (stored,) = kv.take_events()
    assert stored.block_hashes == [second.block_hashes[2]]
    assert stored.parent_block_hash == second.block_hashes[1]
    assert stored.token_ids == list(range(8, 12))
