"""``ProcessedPrompt``: what input processing makes of one prompt, once per request.

Token ids (chat template rendered, image placeholders expanded) and the prompt's image items
(identifier + placeholder span). Pixels are not part of it: an item holds a way to make them
(``PixelSource``), used only when the engine core must encode the image and does not hold its
pixels already. Its wire form (``to_wire``/``from_wire``) is what a pod returns to the router
and what the next pod of a disaggregated pool takes instead of rendering the request again.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from epdserve.engine.inputs.hashing import salted_id

# a multimodal identifier (blake3 hex), ``.<crop>`` for a pan-and-scan crop
_MM_ID = re.compile(r"[0-9a-f]{64}(\.[1-9][0-9]?)?")


class PixelSource:
    """One image's processed pixels ``[1 + crops, 3, H, W]``, made on first use, kept once."""

    def __init__(self, make: Callable[[], np.ndarray]):
        self._make, self._pixels = make, None

    def pixels(self) -> np.ndarray:
        if self._pixels is None:
            self._pixels = self._make()
            self._make = None  # the encoded bytes it held can go
        return self._pixels


@dataclass
class PromptItem:
    """One image (or crop) of a prompt: its identifier and placeholder span."""

    identifier: str
    offset: int  # first placeholder token position in the prompt
    length: int  # number of placeholder tokens
    source: PixelSource | None = None  # None: the pod never had the image (processed upstream)
    crop: int = 0  # index into the source's pixels

    @property
    def end(self) -> int:
        return self.offset + self.length

    def pixels(self) -> np.ndarray | None:
        return None if self.source is None else self.source.pixels()[self.crop]


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    items: list[PromptItem] = field(default_factory=list)
    text: str | None = None  # the prompt's text, when known (echo, logs)

    def salt_items(self, cache_salt: str | None) -> None:
        """Rename the items for a request of ``cache_salt`` (none: unchanged), so its
        encoder outputs (cache, store keys, block-hash extra keys) share with no other salt."""
        if cache_salt:
            for item in self.items:
                item.identifier = salted_id(item.identifier, cache_salt)

    def to_wire(self) -> dict:
        return {
            "prompt_token_ids": self.token_ids,
            "mm_items": [
                {"id": i.identifier, "offset": i.offset, "length": i.length} for i in self.items
            ],
        }


@dataclass(frozen=True)
class PromptRules:
    """What a prompt made elsewhere must satisfy on this pod."""

    vocab_size: int
    image_token_id: int | None = None  # None: a text-only model (no image items allowed)
    tokens_per_image: int = 0
    max_items: int = 0


def from_wire(obj, rules: PromptRules, where: str = "processed_prompt") -> ProcessedPrompt:
    """A processed prompt from the request body, checked as strictly as one made here:
    ids in the vocabulary, every image item a well-formed identifier over exactly one run of
    image placeholder tokens, and every such run covered by an item."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: must be an object")
    unknown = set(obj) - {"prompt_token_ids", "mm_items", "signature"}  # signature: the caller's
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown field")
    ids = obj.get("prompt_token_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{where}.prompt_token_ids: must be a non-empty list of token ids")
    for t in ids:
        if type(t) is not int or not 0 <= t < rules.vocab_size:
            raise ValueError(f"{where}.prompt_token_ids: token ids must be within the vocabulary")
    raw_items = obj.get("mm_items") or []
    if not isinstance(raw_items, list):
        raise ValueError(f"{where}.mm_items: must be a list")
    if raw_items and rules.image_token_id is None:
        raise ValueError(f"{where}.mm_items: this model takes no image inputs")
    if len(raw_items) > rules.max_items:
        raise ValueError(f"{where}.mm_items: at most {rules.max_items} items")
    items = [_item(raw, f"{where}.mm_items[{k}]") for k, raw in enumerate(raw_items)]
    _check_spans(ids, items, rules, where)
    return ProcessedPrompt(list(ids), items)


def _item(raw, where: str) -> PromptItem:
    if not isinstance(raw, dict) or set(raw) != {"id", "offset", "length"}:
        raise ValueError(f"{where}: must be an object with id, offset and length")
    ident, offset, length = raw["id"], raw["offset"], raw["length"]
    if not isinstance(ident, str) or not _MM_ID.fullmatch(ident):
        raise ValueError(f"{where}.id: not a multimodal identifier")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 1:
        raise ValueError(f"{where}: offset and length must be non-negative integers")
    return PromptItem(ident, offset, length)


def _check_spans(ids: list[int], items: list[PromptItem], rules: PromptRules, where: str):
    if rules.image_token_id is None:
        return
    runs = placeholder_spans(ids, rules.image_token_id)
    spans = [(i.offset, i.length) for i in items]
    if spans != runs:
        raise ValueError(
            f"{where}.mm_items: the items' spans {spans[:4]} do not match the image placeholder "
            f"runs of prompt_token_ids {runs[:4]}"
        )
    if rules.tokens_per_image and any(i.length != rules.tokens_per_image for i in items):
        raise ValueError(f"{where}.mm_items: each item spans {rules.tokens_per_image} tokens")


def placeholder_spans(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each run of image placeholder tokens, in order."""
    spans, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            spans.append((start, i - start))
            start = None
    return spans
