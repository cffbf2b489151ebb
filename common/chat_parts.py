"""Where a chat request's images are: the one walker of OpenAI ``messages`` content parts.

Works on plain JSON (``dict``/``list``), so the router (no pydantic models of the engine)
and the engine's input processor read a request the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple


class ImagePart(NamedTuple):
    """One ``image_url`` content part: its place in the request and its URL."""

    message: int
    part: int
    url: str | None  # None: the part names no URL (the engine refuses it, naming ``where``)

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def image_parts(messages) -> Iterator[ImagePart]:
    """Every ``image_url`` part of ``messages``, in order (malformed entries are skipped:
    validation is the engine's, which names the field)."""
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            yield ImagePart(i, j, url if isinstance(url, str) else None)


def image_urls(messages) -> list[str]:
    """The URLs of the images of ``messages``, in order."""
    return [p.url for p in image_parts(messages) if p.url is not None]


def without_images(messages) -> list:
    """``messages`` with every ``image_url`` part removed (for a pod that takes the request's
    processed prompt and never needs the image bytes again)."""
    out = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            kept = [p for p in content if not (isinstance(p, dict) and p.get("type") == "image_url")]
            message = {**message, "content": kept}
        out.append(message)
    return out
