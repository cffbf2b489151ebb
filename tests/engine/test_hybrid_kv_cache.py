"""Hybrid KV cache (Gemma3): a full-attention group beside sliding-window groups over one pool.

Exact-state tests of the sliding-window rules and the coordinator, then the engine: fewer
live blocks, prefix hits both kinds agree on, and outputs equal to transformers'.
"""

from __future__ import annotations

import random

import pytest
from conftest_helpers import assert_no_leak, make_kv_request

from epdserve.engine import LLM, SamplingParams
from epdserve.engine.core.engine_core import EngineCoreRequest
from epdserve.engine.core.kv_cache_groups import KVCacheGroup, make_kv_cache_spec
from epdserve.engine.core.kv_cache_manager import KVCacheManager

BS = 16
W = 32  # tiny Gemma3's sliding window: a query needs cdiv(31, 16) = 2 blocks before it
GEMMA3_TINY = [W, W, W, None]  # one global layer in four


def hybrid_manager(num_blocks: int, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, spec=make_kv_cache_spec(GEMMA3_TINY), **kw)


def make_request(req_id: str, tokens: list[int]):
    return make_kv_request(req_id, tokens, BS)


def live(blocks) -> list[int]:
    return [b.block_id for b in blocks if not b.is_null]


def test_layers_are_grouped_by_kind_with_full_attention_first_and_equal_group_sizes():
    spec = make_kv_cache_spec(GEMMA3_TINY)
    assert spec.groups == (
        KVCacheGroup((3,), None),
        KVCacheGroup((0,), W),
        KVCacheGroup((1,), W),
        KVCacheGroup((2,), W),
    )
    assert spec.slots == 1 and spec.layer_placement() == [(1, 0), (2, 0), (3, 0), (0, 0)]
    gemma_like = ([W] * 5 + [None]) * 2  # 10 sliding, 2 global: groups of two layers
    spec = make_kv_cache_spec(gemma_like)
    assert spec.slots == 2 and [g.layers for g in spec.groups] == [
        (5, 11),
        (0, 1),
        (2, 3),
        (4, 6),
        (7, 8),
        (9, 10),
    ]
    assert make_kv_cache_spec(gemma_like, hybrid=False).groups == (KVCacheGroup(tuple(range(12))),)
    assert make_kv_cache_spec([None] * 3).slots == 3  # plain models: one group of every layer
    assert make_kv_cache_spec([W] * 3).groups == (KVCacheGroup((0, 1, 2), W),)


def test_sliding_groups_free_blocks_out_of_the_window_and_the_full_group_keeps_them():
    kv = hybrid_manager(40)
    r = make_request("a", list(range(70)))
    new = kv.allocate_slots(r, 70)  # 5 blocks in each of the 4 groups
    assert [len(g) for g in new] == [5, 5, 5, 5] and kv.num_free_blocks() == 19
    r.num_computed_tokens = 70
    kv.allocate_slots(r, 1)  # the next query at 70 sees (38, 70]: blocks 0 and 1 are out
    full, *sliding = kv.req_blocks["a"]
    assert len(live(full)) == 5
    for group in sliding:
        assert [b.is_null for b in group] == [True, True, False, False, False]
    assert kv.num_free_blocks() == 19 + 3 * 2
    kv.free(r)
    assert kv.num_free_blocks() == 39
    kv.pool.check_integrity()


def computed_past_the_window(kv: KVCacheManager, req_id: str, tokens: list[int]):
    """A request whose 70 tokens are computed, one more allocated: sliding blocks 0 and 1
    are out of the next query's window, so they were freed (and stay cached while free)."""
    request = make_request(req_id, tokens)
    kv.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    kv.allocate_slots(request, 1)
    return request


def test_sliding_hit_is_found_right_to_left_and_needs_no_blocks_before_the_window():
    kv = hybrid_manager(40)
    tokens = list(range(70))
    a = computed_past_the_window(kv, "a", tokens)
    b = make_request("b", tokens)
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 * BS  # (70 - 1) // 16 whole blocks
    full, *sliding = hits
    assert [blk.block_id for blk in full] == kv.get_group_block_ids("a")[0][:4]
    for g, group in enumerate(sliding, start=1):
        # only the two blocks before the hit's end are used; the rest is the null block
        assert [blk.is_null for blk in group] == [True, True, False, False]
        assert live(group) == kv.get_group_block_ids("a")[g][2:4]
    assert kv.allocate_slots(b, 70 - n, n, hits) is not None
    assert all(len(g) == 5 for g in kv.req_blocks["b"])
    kv.free(a)
    kv.free(b)
    kv.pool.check_integrity()


def test_the_hit_is_the_longest_prefix_every_group_agrees_on():
    kv = hybrid_manager(48)
    tokens = list(range(70))
    a = computed_past_the_window(kv, "a", tokens)  # sliding blocks 0, 1: first to be evicted
    kv.free(a)
    first_sliding = kv.pool.get_cached_block(a.block_hashes[0], 1)
    fillers = 0
    while kv.pool.get_cached_block(a.block_hashes[0], 1) is first_sliding:
        kv.allocate_slots(make_request(f"f{fillers}", [9000 + fillers]), 1)
        fillers += 1
    assert kv.pool.get_cached_block(a.block_hashes[0], 0) is not None  # the full group has it
    # a prompt sharing 2 blocks with a: full attention could reuse 32 tokens, but the sliding
    # groups lost block 0 (and block 1 is no use without it): nothing is reused
    b = make_request("b", tokens[:40])
    hits, n = kv.get_computed_blocks(b)
    assert n == 0 and hits == ([], [], [], [])
    # a prompt ending where the sliding blocks 2, 3 still are: both kinds agree on 4 blocks
    c = make_request("c", tokens[:65])
    hits, n = kv.get_computed_blocks(c)
    assert n == 64 and [len(live(g)) for g in hits] == [4, 2, 2, 2]


def test_kv_events_name_each_group():
    kv = hybrid_manager(40, enable_events=True)
    kv.allocate_slots(make_request("a", list(range(40))), 40)
    events = kv.take_events()
    assert sorted(e.group_idx for e in events) == [0, 1, 2, 3]
    assert all(len(e.block_hashes) == 2 for e in events)


# --- the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_prompts(models, hf_reference):
    path = models.get("gemma3")
    rng = random.Random(7)
    shared = [rng.randrange(10, 4000) for _ in range(120)]
    prompts = [shared + [rng.randrange(10, 4000) for _ in range(n)] for n in (30, 45)]
    return path, prompts, hf_reference.greedy(path, prompts, max_new=12)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_gemma3_prefix_hit_across_groups_is_token_exact(long_prompts):
    path, prompts, ref = long_prompts
    llm = LLM(model=str(path), max_model_len=512, max_num_batched_tokens=32)
    assert llm.engine.kv.num_groups == 4
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)[0]
    second = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY)[0]
    assert second.num_cached_tokens == 112  # the shared 120 tokens, in whole blocks
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == ref
    assert_no_leak(llm)


def test_gemma3_sliding_groups_hold_only_the_window(long_prompts):
    path, prompts, ref = long_prompts
    llm = LLM(model=str(path), max_model_len=512, max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request(EngineCoreRequest("r", prompts[1], GREEDY))
    peak = [0, 0, 0, 0]
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        for g, blocks in enumerate(engine.kv.req_blocks.get("r", ())):
            peak[g] = max(peak[g], len(live(blocks)))
    assert tokens == ref[1]
    total = len(prompts[1]) + 12 - 1  # the last sampled token is never attended to
    assert peak[0] == -(-total // BS)  # full attention: the whole sequence
    # sliding: the window before the step's first query plus a 32-token chunk
    assert all(p <= -(-(W - 1 + 32) // BS) + 1 for p in peak[1:])
    assert_no_leak(llm)


def test_hybrid_cache_fits_more_blocks_in_the_same_memory(models):
    path = str(models.get("gemma3"))
    hybrid = LLM(model=path, max_model_len=256, kv_cache_memory=4 << 20)
    single = LLM(
        model=path, max_model_len=256, kv_cache_memory=4 << 20, disable_hybrid_kv_cache_manager=True
    )
    assert single.engine.kv.num_groups == 1
    assert hybrid.engine.num_blocks == 4 * single.engine.num_blocks
