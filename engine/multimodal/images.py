"""Loading images from OpenAI ``image_url`` parts, with limits (formats, bytes, pixels, time).

Data URLs are always accepted; ``http(s)`` URLs only for hosts on an explicit allow-list
(``--allowed-media-domains``); ``file://`` URLs only below ``--allowed-local-media-path``.
Every failure raises ``ValueError`` whose message starts with the part's name, so the
server can answer 400 naming it. The API server uses ``load_image_url_async``: fetching is
asynchronous and decoding runs in a worker thread, so no image stalls the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20
    max_pixels: int = 40_000_000
    formats: tuple[str, ...] = ALLOWED_FORMATS
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)
    fetch_timeout_s: float = 10.0
    local_media_path: str | None = None  # file:// URLs must resolve below this directory


@dataclass(frozen=True)
class LoadedImage:
    image: object  # PIL.Image.Image, RGB
    raw: bytes  # the original encoded bytes (what the multimodal hash covers)


def load_image_url(url: str, limits: ImageLimits, where: str) -> LoadedImage:
    """Decode a data URL (or fetch an allow-listed http(s) URL) into an RGB PIL image."""
    if url.startswith("data:"):
        raw = _decode_data_url(url, limits, where)
    elif url.startswith(("http://", "https://")):
        raw = _fetch(url, limits, where)
    elif url.startswith("file:"):
        raw = _read_local(url, limits, where)
    else:
        raise _bad_scheme(where)
    return LoadedImage(decode_image(raw, limits, where), raw)


async def load_image_url_async(url: str, limits: ImageLimits, where: str) -> LoadedImage:
    """``load_image_url`` for the event loop: the fetch is awaited, decoding is threaded."""
    if url.startswith(("http://", "https://")):
        raw = await _fetch_async(url, limits, where)
        return LoadedImage(await asyncio.to_thread(decode_image, raw, limits, where), raw)
    if not url.startswith(("data:", "file:")):
        raise _bad_scheme(where)
    return await asyncio.to_thread(load_image_url, url, limits, where)


def _bad_scheme(where: str) -> ValueError:
    return ValueError(
        f"{where}: unsupported image URL scheme (use a data: URL, an allow-listed http(s) "
        "URL, or a file: URL below the allowed local media path)"
    )


def _read_local(url: str, limits: ImageLimits, where: str) -> bytes:
    if not limits.local_media_path:
        raise ValueError(f"{where}: file URLs are not allowed (see --allowed-local-media-path)")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"{where}: file URLs must name a local path")
    root = os.path.realpath(limits.local_media_path)
    path = os.path.realpath(unquote(parsed.path))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"{where}: the file is outside the allowed local media path")
    try:
        with open(path, "rb") as f:
            raw = f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read the file ({exc.strerror})") from None
    if len(raw) > limits.max_bytes:
        raise ValueError(f"{where}: image is larger than {limits.max_bytes} bytes")
    return raw


def _check_host(url: str, limits: ImageLimits, where: str) -> None:
    host = urlparse(url).hostname or ""
    if host not in limits.allowed_hosts:
        raise ValueError(
            f"{where}: fetching images from {host!r} is not allowed (see --allowed-media-domains)"
        )


async def _fetch_async(url: str, limits: ImageLimits, where: str) -> bytes:
    import httpx

    _check_host(url, limits, where)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            async with (
                httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=False) as client,
                client.stream("GET", url) as resp,
            ):
                resp.raise_for_status()
                async for chunk in resp.aiter_bytes():
                    size += len(chunk)
                    if size > limits.max_bytes:
                        raise ValueError(f"{where}: image is larger than {limits.max_bytes} bytes")
                    chunks.append(chunk)
    except TimeoutError:
        raise ValueError(
            f"{where}: fetching the image took longer than {limits.fetch_timeout_s} s"
        ) from None
    except httpx.HTTPError as exc:
        raise ValueError(f"{where}: could not fetch the image ({exc.__class__.__name__})") from exc
    return b"".join(chunks)


def _decode_data_url(url: str, limits: ImageLimits, where: str) -> bytes:
    header, sep, data = url.partition(",")
    if not sep or ";base64" not in header:
        raise ValueError(f"{where}: data URL must be base64 encoded (data:image/...;base64,...)")
    if len(data) * 3 // 4 > limits.max_bytes:
        raise ValueError(f"{where}: image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: invalid base64 image data") from exc


def _fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    import httpx

    _check_host(url, limits, where)
    try:
        with httpx.stream(
            "GET", url, timeout=limits.fetch_timeout_s, follow_redirects=False
        ) as resp:
            resp.raise_for_status()
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise ValueError(f"{where}: image is larger than {limits.max_bytes} bytes")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise ValueError(f"{where}: could not fetch the image ({exc.__class__.__name__})") from exc
    return b"".join(chunks)


def decode_image(raw: bytes, limits: ImageLimits, where: str):
    from PIL import Image, UnidentifiedImageError

    if len(raw) > limits.max_bytes:
        raise ValueError(f"{where}: image is larger than {limits.max_bytes} bytes")
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.format not in limits.formats:
                raise ValueError(
                    f"{where}: image format {img.format} is not accepted; use one of "
                    f"{', '.join(limits.formats)}"
                )
            if img.width * img.height > limits.max_pixels:
                raise ValueError(
                    f"{where}: image has {img.width}x{img.height} pixels, more than "
                    f"{limits.max_pixels}"
                )
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{where}: not a decodable image") from exc
