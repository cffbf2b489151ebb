"""Exact-state tests of multimodal scheduling: span clipping and encoder-input planning."""

from __future__ import annotations

from epdserve.engine.core.encoder_cache_manager import EncoderCacheManager
from epdserve.engine.core.mm_scheduling import (
    MMFeature,
    clip_to_spans,
    plan_encoder_inputs,
    release_passed,
)


def feat(ident: str, offset: int, length: int = 4) -> MMFeature:
    return MMFeature(ident, offset, length, b"", [0])


def test_a_chunk_never_ends_inside_a_span():
    feats = [feat("a", 10), feat("b", 20)]
    assert clip_to_spans(feats, 0, 12) == 10  # stop before span a
    assert clip_to_spans(feats, 0, 14) == 14  # ends exactly at its end
    assert clip_to_spans(feats, 12, 1) == 2  # started inside a: finish it
    assert clip_to_spans(feats, 0, 30) == 30


def test_uncached_images_are_reserved_and_encoded_once():
    cache = EncoderCacheManager(16)
    feats = [feat("a", 2), feat("b", 8)]
    n, todo, used = plan_encoder_inputs("r1", feats, 0, 12, cache, budget=16)
    assert (n, todo, used) == (12, [0, 1], 8)
    n, todo, used = plan_encoder_inputs("r2", feats, 0, 12, cache, budget=16)
    assert (n, todo, used) == (12, [], 0) and cache.hits == 2


def test_encoder_budget_stops_the_chunk_before_the_image():
    cache = EncoderCacheManager(16)
    n, todo, _ = plan_encoder_inputs("r1", [feat("a", 2), feat("b", 8)], 0, 12, cache, budget=4)
    assert (n, todo) == (8, [0])


def test_images_outside_the_chunk_are_ignored_and_passed_ones_released():
    cache = EncoderCacheManager(16)
    feats = [feat("a", 2), feat("b", 20)]
    n, todo, _ = plan_encoder_inputs("r1", feats, 0, 10, cache, budget=16)
    assert todo == [0]
    release_passed("r1", feats, 10, cache)
    assert list(cache.freeable) == ["a"]
