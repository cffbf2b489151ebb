"""Where a chat request's images are, and what its template renders: the one walker of
OpenAI ``messages`` content parts.

Works on plain JSON (``dict``/``list``), so the router (no pydantic models of the engine)
and the engine's input processor read a request the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
# what a message carries to the template besides its content (as the OpenAI API names them)
MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")


class ImagePart(NamedTuple):
    """One image content part: its place in the request and its URL."""

    message: int
    part: int
    url: str | None  # None: the part names no URL (the engine refuses it, naming ``where``)

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def _image_url(part) -> tuple[bool, str | None]:
    """Whether ``part`` is an image part, and its URL (``image_url.url`` or ``image_url``)."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
        return False, None
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    return True, url if isinstance(url, str) else None


def _contents(messages) -> Iterator[tuple[int, dict, object]]:
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        yield i, message, content


def image_parts(messages) -> Iterator[ImagePart]:
    """Every image part of ``messages``, in order (malformed entries are skipped:
    validation is the engine's, which names the field)."""
    for i, _, content in _contents(messages):
        for j, part in enumerate(content if isinstance(content, list) else []):
            is_image, url = _image_url(part)
            if is_image:
                yield ImagePart(i, j, url)


def image_urls(messages) -> list[str]:
    """The URLs of the images of ``messages``, in order."""
    return [p.url for p in image_parts(messages) if p.url is not None]


def without_images(messages) -> list:
    """``messages`` with every image part removed (for a pod that takes the request's
    processed prompt and never needs the image bytes again)."""
    out = []
    for _, message, content in _contents(messages):
        if isinstance(content, list):
            kept = [p for p in content if not _image_url(p)[0]]
            message = {**message, "content": kept}
        out.append(message)
    return out


def template_messages(messages) -> tuple[list[dict], list[ImagePart]]:
    """The messages a chat template renders, and the request's image parts in order.

    Each message keeps its role and the OpenAI fields a template may read (``name``,
    ``tool_calls``, ...). Its content becomes: a string as given (``None``: ""); parts whose
    images become ``{"type": "image"}`` (the processor expands each into its placeholder
    tokens) and text ``{"type": "text", "text": ...}``; parts that are all text are joined
    into one string. Raises ``ValueError`` naming a message that is not an object or whose
    content is neither a string nor a list of parts."""
    if not isinstance(messages, list):
        raise ValueError("messages: must be a list")
    out, images = [], []
    for i, message, content in _contents(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: must be an object")
        if isinstance(content, list):
            parts, found = [], []
            for j, part in enumerate(content):
                is_image, url = _image_url(part)
                if is_image:
                    found.append(ImagePart(i, j, url))
                    parts.append({"type": "image"})
                elif isinstance(part, dict) and part.get("type") == "text":
                    parts.append({"type": "text", "text": part.get("text") or ""})
            content = parts if found else "".join(p["text"] for p in parts)
            images += found
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: must be a string or a list of parts")
        rendered = {"role": message.get("role"), "content": content or ""}
        rendered.update((k, message[k]) for k in MESSAGE_FIELDS if message.get(k) is not None)
        out.append(rendered)
    return out, images
