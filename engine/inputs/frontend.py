"""The API server's multimodal side: image URLs in, token ids + engine features out."""

from __future__ import annotations

import json
from pathlib import Path

from epdserve.engine.core.interfaces import MMFeature
from epdserve.engine.inputs.budget import check_request_pixels
from epdserve.engine.inputs.images import (
    ImageLimits,
    LoadedImage,
    load_image_url,
    load_image_url_async,
)
from epdserve.engine.inputs.processor import ImageProcessor
from epdserve.engine.tokenizer import TokenizerInfo


def is_multimodal(model_dir: str) -> bool:
    path = Path(model_dir) / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())


class FrontendMultimodal:
    def __init__(
        self,
        model_dir: str,
        model_id: str,
        tokenizer: TokenizerInfo,
        limits: ImageLimits | None = None,
        max_images: int = 8,
        processor_kwargs: dict | None = None,
    ):
        self.limits = limits or ImageLimits()
        self.max_images = max_images
        self.processor = ImageProcessor(
            model_dir, model_id, tokenizer, max_images=max_images, processor_kwargs=processor_kwargs
        )

    def load(self, url: str, where: str) -> LoadedImage:
        return load_image_url(url, self.limits, where)

    async def load_async(self, url: str, where: str) -> LoadedImage:
        return await load_image_url_async(url, self.limits, where)

    def process(
        self,
        text: str,
        images: list[LoadedImage],
        add_special_tokens: bool = False,
        processor_kwargs: dict | None = None,
    ) -> tuple[list[int], list[MMFeature]]:
        """Token ids with expanded placeholders, and the engine features of the images
        (pan-and-scan crops are features of their own). The request's pixel budget is
        checked before any image is decoded."""
        check_request_pixels(images, self.limits)
        processed = self.processor.process(text, images, add_special_tokens, processor_kwargs)
        features = [
            MMFeature(
                m.identifier,
                m.offset,
                m.length,
                m.pixel_values.tobytes(),
                list(m.pixel_values.shape),
            )
            for m in processed.mm_items
        ]
        return processed.token_ids, features
