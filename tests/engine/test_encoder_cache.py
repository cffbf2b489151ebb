"""Exact-state tests of the encoder cache manager and the processor cache."""

from __future__ import annotations

import pytest

from epdserve.engine.core.encoder_cache_manager import EncoderCacheManager
from epdserve.engine.inputs.prompt import placeholder_spans


def test_first_use_misses_then_a_second_request_hits_and_shares():
    m = EncoderCacheManager(16)
    assert m.check_and_update_cache("r1", "img") is False
    m.allocate("r1", "img", 4)
    assert m.check_and_update_cache("r2", "img") is True
    assert m.refs["img"] == {"r1", "r2"} and m.num_free == 12
    assert (m.queries, m.hits) == (2, 1)


def test_unreferenced_outputs_stay_cached_until_space_is_needed():
    m = EncoderCacheManager(8)
    m.allocate("r1", "a", 4)
    m.allocate("r2", "b", 4)
    m.free("r1", ["a"])
    assert m.check_and_update_cache("r3", "a") is True  # still cached after its user left
    m.free("r3", ["a"])
    m.free("r2", ["b"])
    assert list(m.freeable) == ["a", "b"]
    m.allocate("r4", "c", 4)  # evicts the oldest unreferenced entry only
    assert m.take_freed() == ["a"] and "b" in m.refs and m.take_freed() == []


def test_referenced_outputs_are_never_evicted():
    m = EncoderCacheManager(8)
    m.allocate("r1", "a", 4)
    m.allocate("r2", "b", 4)
    assert not m.can_allocate(1)
    with pytest.raises(ValueError):
        m.allocate("r3", "c", 1)
    m.free("r2", ["b"])
    assert m.can_allocate(4) and not m.can_allocate(5)


def test_placeholder_spans_find_each_run():
    assert placeholder_spans([1, 6, 6, 2, 6, 6, 6], 6) == [(1, 2), (4, 3)]
