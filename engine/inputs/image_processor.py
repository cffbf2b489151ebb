"""Prompt + images -> token ids with expanded image placeholders + image items.

Pixels come from the model's HF image processor, made only when the engine core needs them;
the placeholder expansion is the HF processor's own (``replace_image_token``), tokenized with the
engine's tokenizer, so token ids match ``Gemma3Processor`` exactly.

Pan-and-scan (``do_pan_and_scan``): a wide or tall image also yields up to N crops, each
its own placeholder span after the original's; each crop is one engine item, named
``<image id>.<crop>``, so crops are encoded, cached and shared like images.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from functools import partial
from pathlib import Path

import numpy as np

from epdserve.engine.inputs.hashing import mm_hash
from epdserve.engine.inputs.images import LoadedImage
from epdserve.engine.inputs.prompt import (
    PixelSource,
    ProcessedPrompt,
    PromptItem,
    placeholder_spans,
)
from epdserve.engine.tokenizer import TokenizerInfo

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
    """Image inputs of one image+text model: identifiers, placeholder expansion, pixels.

    An image is named (hashed) from its encoded bytes before anything is decoded; its pixels
    are made only when asked for (``PixelSource``), i.e. when the engine core must encode it
    and does not hold them already."""

    def __init__(
        self,
        model_dir: str,
        model_id: str,
        tokenizer: TokenizerInfo,
        max_images: int = 8,
        processor_kwargs: dict | None = None,
    ):
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(model_dir)
        self.model_id = model_id
        self.tok = tokenizer
        self.max_images = max_images
        self.boi_token = self.hf.boi_token
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.image_token_id = config["image_token_index"]  # the soft token, not the marker
        self.tokens_per_image = int(config.get("mm_tokens_per_image", 0))
        self.size = dict(self.hf.image_processor.size)
        defaults = getattr(self.hf, "images_kwargs", {})
        self.defaults = {k: defaults[k] for k in PROCESSOR_KWARGS if k in defaults}
        self.defaults.update(check_processor_kwargs(processor_kwargs))
        self.max_crops = int(self.defaults.get("pan_and_scan_max_num_crops", 0) or 0)
        # identifier -> crops (pan-and-scan): a repeated image is never decoded to count them
        self.crops: OrderedDict[str, int] = OrderedDict()

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
        named = []  # (identifier, pixel source, crops) per image
        for image in images:
            ident = mm_hash(
                self.model_id, "image", image.item_bytes(), {"size": self.size, **options}
            )
            source = PixelSource(partial(self._pixels, image, options))
            named.append((ident, source, self._num_crops(ident, source, options)))
        parts = prompt.split(self.boi_token)
        expanded = parts[0]
        for (_, _, crops), part in zip(named, parts[1:], strict=True):
            expanded += self.hf.replace_image_token({"num_crops": [crops]}, 0) + part
        ids = self.tok.encode(expanded, add_special_tokens=add_special_tokens)
        spans = iter(placeholder_spans(ids, self.image_token_id))
        items = []
        for ident, source, crops in named:
            for crop in range(1 + crops):
                offset, length = next(spans)
                name = ident if crop == 0 else f"{ident}.{crop}"
                items.append(PromptItem(name, offset, length, source, crop))
        return ProcessedPrompt(ids, items, prompt)

    def _num_crops(self, ident: str, source: PixelSource, options: dict) -> int:
        """0 without pan-and-scan; else counted once per image (that needs its pixels)."""
        if not options:
            return 0
        if ident not in self.crops:
            self.crops[ident] = len(source.pixels()) - 1
            while len(self.crops) > 4096:
                self.crops.popitem(last=False)
        self.crops.move_to_end(ident)
        return self.crops[ident]

    def _pixels(self, image: LoadedImage, options: dict) -> np.ndarray:
        """One image decoded and processed; its RGB image is released on return."""
        out = self.hf.image_processor(images=[image.decode()], return_tensors="np", **options)
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
