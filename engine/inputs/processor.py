"""Prompt + images -> token ids with expanded image placeholders + pixel tensors.

Pixels come from the model's HF image processor (cached by multimodal hash, LRU); the
placeholder expansion is the HF processor's own (``replace_image_token``), tokenized with the
engine's tokenizer, so token ids match ``Gemma3Processor`` exactly.

Pan-and-scan (``do_pan_and_scan``): a wide or tall image also yields up to N crops, each
its own placeholder span after the original's; each crop is one engine item, named
``<image id>.<crop>``, so crops are encoded, cached and shared like images.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epdserve.engine.inputs.hashing import mm_hash
from epdserve.engine.inputs.images import LoadedImage
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


PROCESSOR_KWARGS = {
    "do_pan_and_scan": bool,
    "pan_and_scan_min_crop_size": int,
    "pan_and_scan_max_num_crops": int,
    "pan_and_scan_min_ratio_to_activate": (int, float),
}


def check_processor_kwargs(kwargs, where: str = "mm_processor_kwargs") -> dict:
    """Validate image-processor options: known names, right types, sane values."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{where}: must be an object, got {type(kwargs).__name__}")
    for name, value in kwargs.items():
        kind = PROCESSOR_KWARGS.get(name)
        if kind is None:
            raise ValueError(
                f"{where}.{name}: unknown option; supported: {', '.join(PROCESSOR_KWARGS)}"
            )
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"{where}.{name}: wrong type {type(value).__name__}")
        if kind is not bool and not 0 < value <= 4096:
            raise ValueError(f"{where}.{name}: must be in (0, 4096], got {value}")
    return dict(kwargs)


class ImageProcessor:
    """The frontend's multimodal input processor for one image+text model."""

    def __init__(
        self,
        model_dir: str,
        model_id: str,
        tokenizer: TokenizerInfo,
        cache_items: int = 256,
        max_images: int = 8,
        processor_kwargs: dict | None = None,
    ):
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(model_dir)
        self.model_id = model_id
        self.tok = tokenizer
        self.cache = ProcessorCache(cache_items)
        self.max_images = max_images
        self.boi_token = self.hf.boi_token
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.image_token_id = config["image_token_index"]  # the soft token, not the marker
        self.size = dict(self.hf.image_processor.size)
        defaults = getattr(self.hf, "images_kwargs", {})
        self.defaults = {k: defaults[k] for k in PROCESSOR_KWARGS if k in defaults}
        self.defaults.update(check_processor_kwargs(processor_kwargs))

    def process(
        self,
        prompt: str,
        images: list[LoadedImage],
        add_special_tokens: bool = False,
        processor_kwargs: dict | None = None,
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
        options = {**self.defaults, **check_processor_kwargs(processor_kwargs)}
        if not options.get("do_pan_and_scan"):  # the other options only matter with it
            options = {}
        named = []  # (identifier, [1 + crops, 3, H, W]) per image
        for image in images:
            # hashed from the encoded bytes: a cached image is never decoded again
            ident = mm_hash(
                self.model_id, "image", image.item_bytes(), {"size": self.size, **options}
            )
            pixels = self.cache.get(ident)
            if pixels is None:
                pixels = self._pixels(image, options)
                self.cache.put(ident, pixels)
            named.append((ident, pixels))
        parts = prompt.split(self.boi_token)
        expanded = parts[0]
        for (_, pixels), part in zip(named, parts[1:], strict=True):
            expanded += self.hf.replace_image_token({"num_crops": [len(pixels) - 1]}, 0) + part
        ids = self.tok.encode(expanded, add_special_tokens=add_special_tokens)
        spans = iter(placeholder_spans(ids, self.image_token_id))
        items = []
        for ident, pixels in named:
            for crop, crop_pixels in enumerate(pixels):
                offset, length = next(spans)
                name = ident if crop == 0 else f"{ident}.{crop}"
                items.append(MMItem(name, crop_pixels, offset, length))
        return ProcessedPrompt(ids, items)

    def _pixels(self, image: LoadedImage, options: dict) -> np.ndarray:
        """One image decoded and processed; its RGB image is released on return, before
        the next image is decoded."""
        out = self.hf.image_processor(images=[image.decode()], return_tensors="np", **options)
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32)


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
