"""PrefixIndex: exact chained keys, eviction, pod removal, capacity, legacy inputs."""

from __future__ import annotations

import pytest

from epdserve.connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys

BS = 4


def stored(hashes, parent, tokens, extra=None, lora=None):
    return BlockStored(list(hashes), parent, list(tokens), BS, None, "GPU", lora, extra, 0)


def batch(*events):
    return EventBatch(0.0, list(events), 0)


PROMPT = list(range(100, 116))  # 4 blocks of 4


def test_stored_blocks_match_the_request_keys_of_the_same_tokens():
    index = PrefixIndex()
    index.apply("a", batch(stored([11, 12], None, PROMPT[:8]), stored([13, 14], 12, PROMPT[8:])))
    keys = request_keys(PROMPT + [1, 2], BS)
    assert len(keys) == 4
    assert index.match(keys, ["a", "b"]) == {"a": 4, "b": 0}
    index.check_integrity()


def test_keys_do_not_depend_on_the_engine_hashes():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2, 3, 4], None, PROMPT)))
    index.apply("b", batch(stored([91, 92, 93, 94], None, PROMPT)))  # another seed
    assert len(index) == 4
    assert index.match(request_keys(PROMPT, BS), ["a", "b"]) == {"a": 4, "b": 4}


def test_match_counts_only_the_consecutive_prefix():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2, 3, 4], None, PROMPT)))
    other = PROMPT[:4] + [0, 0, 0, 0] + PROMPT[8:]
    assert index.match(request_keys(other, BS), ["a"]) == {"a": 1}


def test_block_removed_evicts_and_cuts_the_chain():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2, 3, 4], None, PROMPT)))
    index.apply("a", batch(BlockRemoved([2], "GPU")))
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 1}
    assert len(index) == 3
    index.check_integrity()


def test_a_hybrid_models_sliding_window_groups_are_not_indexed():
    index = PrefixIndex()
    sliding = BlockStored([1, 2], None, PROMPT[:8], BS, None, "GPU", None, None, 1)
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8]), sliding))
    assert len(index) == 2
    # a sliding group dropping its copy does not hide the full-attention group's blocks
    index.apply("a", batch(BlockRemoved([1, 2], "GPU", 1)))
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 2}
    index.check_integrity()


def test_a_block_stored_twice_needs_two_removals():
    index = PrefixIndex()
    index.apply("a", batch(stored([1], None, PROMPT[:4]), stored([1], None, PROMPT[:4])))
    index.apply("a", batch(BlockRemoved([1], "GPU")))
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 1}
    index.apply("a", batch(BlockRemoved([1], "GPU")))
    assert len(index) == 0


def test_all_blocks_cleared_drops_only_that_pod():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8])))
    index.apply("b", batch(stored([1, 2], None, PROMPT[:8])))
    result = index.apply("a", batch(AllBlocksCleared()))
    assert result.cleared
    assert index.match(request_keys(PROMPT, BS), ["a", "b"]) == {"a": 0, "b": 2}
    index.check_integrity()


def test_removing_a_pod_forgets_its_blocks():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8])))
    index.apply("b", batch(stored([5], None, PROMPT[:4])))
    index.remove_pod("a")
    assert index.pods() == ["b"] and len(index) == 1
    assert index.match(request_keys(PROMPT, BS), ["a", "b"]) == {"a": 0, "b": 1}


def test_capacity_bounds_the_index_least_recent_first():
    index = PrefixIndex(capacity=3)
    index.apply("a", batch(stored([1, 2, 3], None, PROMPT[:12])))
    index.match(request_keys(PROMPT[:4], BS), ["a"])  # touch block 1
    index.apply("a", batch(stored([9], None, [7, 7, 7, 7])))
    assert len(index) == 3 and index.evicted == 1
    assert index.pod_block_count("a") == 3
    # block 2 (least recent) is gone, so the chain stops after block 1
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 1}
    index.check_integrity()


def test_a_child_whose_parent_is_unknown_is_counted_as_orphaned():
    index = PrefixIndex()
    result = index.apply("a", batch(stored([5, 6], 999, PROMPT[:8])))
    assert result.orphaned == 2 and result.stored == 0 and len(index) == 0


def test_blocks_with_extra_keys_are_not_indexed_from_there_on():
    index = PrefixIndex()
    result = index.apply(
        "a", batch(stored([1, 2, 3], None, PROMPT[:12], extra=[None, ["mm"], None]))
    )
    assert result.stored == 1 and result.skipped == 2
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 1}


def test_lora_blocks_only_match_requests_for_that_lora():
    index = PrefixIndex()
    index.apply("a", batch(stored([1], None, PROMPT[:4], lora="sql")))
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 0}
    assert index.match(request_keys(PROMPT, BS, "sql"), ["a"]) == {"a": 1}


def test_invalid_token_ids_are_skipped_not_raised():
    index = PrefixIndex()
    result = index.apply("a", batch(stored([1], None, [1, 2, 3, -4])))
    assert result.skipped == 1 and len(index) == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)
