"""Loading images from OpenAI ``image_url`` parts, with limits (formats, bytes, pixels, time).

Data URLs are always accepted; ``http(s)`` URLs only for hosts on an explicit allow-list
(``--allowed-media-domains``); ``file://`` URLs only below ``--allowed-local-media-path``.
Every failure raises ``ValueError`` whose message starts with the part's name, so the
server can answer 400 naming it. The API server uses ``load_image_url_async``: fetching is
asynchronous and header checks run in a worker thread, so no image stalls the event loop.
Loading reads only an image's header (``budget.probe``); its pixels are decoded later, one
image at a time, and only when the processor has not already got them (``LoadedImage``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

from epdserve.engine.inputs.budget import ImageHeader, decode_rgb, probe
from epdserve.engine.inputs.hashing import image_item_bytes

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20
    # 25 M: a 24-megapixel camera photo (6000x4000) fits; it decodes to 75 MB of RGB
    max_pixels: int = 25_000_000
    # 100 M: eight 12-megapixel phone photos (4032x3024, 97.5 M) fit; decoded one at a
    # time, so this bounds a request's decode work (about 1-2 s of CPU), not its memory
    max_pixels_per_request: int = 100_000_000
    formats: tuple[str, ...] = ALLOWED_FORMATS
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)
    fetch_timeout_s: float = 10.0
    local_media_path: str | None = None  # file:// URLs must resolve below this directory

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels", "max_pixels_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")


class LoadedImage:
    """One image input: its encoded bytes and their checked header; pixels on demand.

    Holding one costs only its encoded bytes, so a request's images wait for their turn
    without their pixels: ``decode()`` makes the RGB image anew on every call and keeps
    nothing. The offline API may hand over decoded PIL images instead (``pixels``, no
    header: there is nothing left to decode or to charge)."""

    __slots__ = ("pixels", "raw", "header", "where", "limits")

    def __init__(
        self,
        pixels=None,  # PIL.Image.Image, RGB, when the caller already decoded it
        raw: bytes = b"",  # the original encoded bytes (what the multimodal hash covers)
        header: ImageHeader | None = None,
        where: str = "image",
        limits: ImageLimits | None = None,
    ):
        assert pixels is not None or header is not None, "an image needs pixels or a header"
        self.pixels, self.raw, self.header, self.where = pixels, raw, header, where
        self.limits = limits or ImageLimits()

    @property
    def image(self):
        """The RGB image (decoded now, when only the encoded bytes are held)."""
        return self.decode()

    def decode(self):
        if self.pixels is not None:
            return self.pixels
        return decode_rgb(self.raw, self.header, self.limits, self.where)

    def item_bytes(self) -> bytes:
        """What the multimodal hash covers: the encoded bytes (no decoding needed)."""
        return image_item_bytes(self.raw, self.pixels)


def checked(raw: bytes, limits: ImageLimits, where: str) -> LoadedImage:
    """Encoded bytes whose header passed the per-image checks (nothing decoded)."""
    if len(raw) > limits.max_bytes:
        raise ValueError(f"{where}: image is larger than {limits.max_bytes} bytes")
    return LoadedImage(raw=raw, header=probe(raw, limits, where), where=where, limits=limits)


def load_image_url(url: str, limits: ImageLimits, where: str) -> LoadedImage:
    """A data URL (or an allow-listed http(s) or local file URL), its header checked."""
    if url.startswith("data:"):
        raw = _decode_data_url(url, limits, where)
    elif url.startswith(("http://", "https://")):
        raw = _fetch(url, limits, where)
    elif url.startswith("file:"):
        raw = _read_local(url, limits, where)
    else:
        raise _bad_scheme(where)
    return checked(raw, limits, where)


async def load_image_url_async(url: str, limits: ImageLimits, where: str) -> LoadedImage:
    """``load_image_url`` for the event loop: the fetch is awaited, the header check threaded."""
    if url.startswith(("http://", "https://")):
        raw = await _fetch_async(url, limits, where)
        return await asyncio.to_thread(checked, raw, limits, where)
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
    """``raw`` checked and decoded at once: an RGB PIL image."""
    return checked(raw, limits, where).decode()
