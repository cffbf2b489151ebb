"""Prompt + images -> token ids with expanded image placeholders + pixel tensors.

Pixels come from the model's HF image processor (cached by multimodal hash, LRU); the
placeholder expansion is the HF processor's own ``full_image_sequence``, tokenized with the
engine's tokenizer, so token ids match ``Gemma3Processor`` exactly.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epdserve.engine.multimodal.hashing import image_item_bytes, mm_hash
from epdserve.engine.multimodal.images import LoadedImage
from epdserve.engine.tokenizer import TokenizerInfo


@dataclass
class MMItem:
    identifier: str
    pixel_values: np.ndarray  # [3, H, W] float32
    offset: int  # first placeholder token position in the prompt
    length: int  # number of placeholder tokens


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    mm_items: list[MMItem]


class ProcessorCache:
    """LRU of processed pixels by multimodal hash; counts queries and hits."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[str, np.ndarray] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def get(self, key: str) -> np.ndarray | None:
        self.queries += 1
        value = self.items.get(key)
        if value is not None:
            self.hits += 1
            self.items.move_to_end(key)
        return value

    def put(self, key: str, value: np.ndarray) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)


class ImageProcessor:
    """The frontend's multimodal input processor for one image+text model."""

    def __init__(
        self,
        model_dir: str,
        model_id: str,
        tokenizer: TokenizerInfo,
        cache_items: int = 256,
        max_images: int = 8,
    ):
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(model_dir)
        self.model_id = model_id
        self.tok = tokenizer
        self.cache = ProcessorCache(cache_items)
        self.max_images = max_images
        self.boi_token = self.hf.boi_token
        self.full_sequence = self.hf.full_image_sequence
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.image_token_id = config["image_token_index"]  # the soft token, not the marker
        self.kwargs = {"size": dict(self.hf.image_processor.size)}

    def process(
        self, prompt: str, images: list[LoadedImage], add_special_tokens: bool = False
    ) -> ProcessedPrompt:
        if len(images) > self.max_images:
            raise ValueError(
                f"messages: at most {self.max_images} images per request, got {len(images)}"
            )
        if prompt.count(self.boi_token) != len(images):
            raise ValueError(
                f"prompt: has {prompt.count(self.boi_token)} image markers "
                f"({self.boi_token}) for {len(images)} images"
            )
        expanded = prompt.replace(self.boi_token, self.full_sequence)
        ids = self.tok.encode(expanded, add_special_tokens=add_special_tokens)
        spans = placeholder_spans(ids, self.image_token_id)
        items = []
        for image, (offset, length) in zip(images, spans, strict=True):
            ident = mm_hash(
                self.model_id, "image", image_item_bytes(image.raw, image.image), self.kwargs
            )
            pixels = self.cache.get(ident)
            if pixels is None:
                out = self.hf.image_processor(images=[image.image], return_tensors="np")
                pixels = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
                self.cache.put(ident, pixels)
            items.append(MMItem(ident, pixels, offset, length))
        return ProcessedPrompt(ids, items)


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
