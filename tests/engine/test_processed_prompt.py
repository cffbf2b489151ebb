"""The processed prompt's wire form, and the pixel mirror between API process and core."""

from __future__ import annotations

import numpy as np
import pytest

from epdserve.engine.core.interfaces import MMFeature
from epdserve.engine.core.pixel_cache import PixelLRU, PixelReceiver, PixelSender
from epdserve.engine.inputs.prompt import (
    PixelSource,
    ProcessedPrompt,
    PromptItem,
    PromptRules,
    from_wire,
)

IMG = 9  # the image placeholder token of these tests
RULES = PromptRules(vocab_size=100, image_token_id=IMG, tokens_per_image=2, max_items=4)
ID_A, ID_B = "a" * 64, "b" * 64


def wire(ids, items=()):
    return {
        "prompt_token_ids": ids,
        "mm_items": [{"id": i, "offset": o, "length": n} for i, o, n in items],
    }


def test_a_prompt_round_trips_through_its_wire_form():
    prompt = ProcessedPrompt([1, IMG, IMG, 2, IMG, IMG], [PromptItem(ID_A, 1, 2)])
    prompt.items.append(PromptItem(ID_B + ".1", 4, 2))
    back = from_wire(prompt.to_wire(), RULES)
    assert back.token_ids == prompt.token_ids
    assert [(i.identifier, i.offset, i.length, i.source) for i in back.items] == [
        (ID_A, 1, 2, None),
        (ID_B + ".1", 4, 2, None),
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([1, 2], "must be an object"),
        ({"prompt_token_ids": []}, "prompt_token_ids: must be a non-empty"),
        ({"prompt_token_ids": [1, 100]}, "prompt_token_ids: token ids must be within"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids: token ids must be within"),
        ({"prompt_token_ids": [1], "extra": 1}, "processed_prompt.extra: unknown field"),
        (wire([1, IMG, IMG], [("zz", 1, 2)]), r"mm_items\[0\].id: not a multimodal"),
        (wire([1, IMG, IMG], [(ID_A, 0, 2)]), "do not match the image placeholder runs"),
        (wire([1, IMG, IMG]), "do not match the image placeholder runs"),  # a run unnamed
        (wire([1, 2], [(ID_A, 0, 2)]), "do not match the image placeholder runs"),
        (wire([IMG, IMG, IMG], [(ID_A, 0, 3)]), "each item spans 2 tokens"),
        (wire([1, IMG, IMG], [(ID_A, 1, 2)] * 5), "at most 4 items"),
    ],
)
def test_a_malformed_processed_prompt_is_refused_naming_the_field(body, field):
    with pytest.raises(ValueError, match=field):
        from_wire(body, RULES)


def test_a_text_model_takes_no_image_items():
    rules = PromptRules(vocab_size=100)
    assert from_wire({"prompt_token_ids": [1, 9, 9]}, rules).items == []
    with pytest.raises(ValueError, match="takes no image inputs"):
        from_wire(wire([1, 9, 9], [(ID_A, 1, 2)]), rules)


def test_the_lru_evicts_the_least_recently_used_by_bytes():
    lru = PixelLRU(capacity_bytes=10)
    lru.put("a", 4, "A")
    lru.put("b", 4, "B")
    assert lru.touch("a") == "A"  # a is now the most recent
    lru.put("c", 4, "C")  # 12 > 10: b goes
    assert list(lru.items) == ["a", "c"] and lru.bytes == 8
    assert lru.touch("b") is None


def item(ident: str, made: list) -> PromptItem:
    def make():
        made.append(ident)
        return np.full((1, 3, 2, 2), len(made), dtype=np.float32)

    return PromptItem(ident, 0, 4, PixelSource(make))


def test_the_core_holds_exactly_what_the_api_process_believes():
    sender, receiver = PixelSender(capacity_bytes=100), PixelReceiver(capacity_bytes=100)
    made: list = []
    sent = []
    for ident in ["x", "y", "x", "z", "y"]:  # 48 bytes each: two fit
        features = sender.features([item(ident, made)])
        sent.append(bool(features[0].data))
        receiver.resolve(features)
        assert features[0].data, f"{ident}: the core could not fill in its pixels"
        assert list(sender.lru.items) == list(receiver.lru.items)
    assert sent == [True, True, False, True, True]  # y was evicted by z
    assert made == ["x", "y", "z", "y"]  # pixels made only when sent


def test_an_item_named_by_another_pod_travels_without_pixels_and_touches_nothing():
    sender, receiver = PixelSender(), PixelReceiver()
    remote = PromptItem("r" * 64, 3, 4)  # from a processed prompt: no source
    features = sender.features([remote])
    receiver.resolve(features)
    assert features == [MMFeature("r" * 64, 3, 4, b"", [])]
    assert not sender.lru.items and not receiver.lru.items


def test_a_named_only_feature_passes_the_buffer_check():
    MMFeature(ID_A, 0, 4, b"", []).check_buffer(0)
    with pytest.raises(ValueError, match=r"mm_features\[1\]"):
        MMFeature(ID_A, 0, 4, b"\0" * 4, [1, 1, 2]).check_buffer(1)
