"""The pixel budget: what an image costs once decoded, known from its header alone.

``Image.open`` parses only a header (format, size, mode); nothing is decoded until
``load()``/``convert()``. Every image part is probed here first: its structure (a bounded
walk, ``structure.py``), its format, and its size against the per-image bound (a WebP
canvas even before PIL's decoder allocates it). Once
every part of a request is probed, their total is checked against the per-request bound.
Only then are images decoded, one at a time, each released before the next.

The charge is honest: ``width * height`` pixels, ``* 3`` bytes of RGB, which is what the
processor makes of an image. An animated image is taken as its first frame, as a
still-image processor sees it; only that frame is decoded, so only that frame is charged.
Frames are never counted: a GIF has no frame table, and walking the 800,000 frame headers
an 18 MB GIF can hold costs about 2 s of CPU (PIL's ``n_frames`` does exactly that).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from epdserve.engine.inputs.structure import check_structure

RGB_BYTES = 3  # per pixel of what the processor makes: one RGB frame
PIL_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # the only parsers client bytes reach


@dataclass(frozen=True)
class ImageHeader:
    """An encoded image's format and (first frame's) size, read without decoding it."""

    format: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def rgb_bytes(self) -> int:
        return self.pixels * RGB_BYTES


class PixelLimits(Protocol):
    max_pixels: int  # per image
    max_pixels_per_request: int
    formats: tuple[str, ...]


class Charged(Protocol):
    header: ImageHeader | None  # None: pixels the caller handed over, nothing to decode
    where: str


def probe(raw: bytes, limits: PixelLimits, where: str) -> ImageHeader:
    """The header of ``raw``, refused (``ValueError`` naming ``where``) when its format is not
    accepted or its size passes the per-image bound. Decodes nothing."""
    check_structure(raw, where)  # PIL's parsing loops stay bounded
    canvas = webp_canvas(raw)
    if canvas is not None:  # PIL's WebP decoder allocates the canvas when the file is opened
        check_image_pixels(*canvas, limits, where)
    with _open(raw, limits, where) as img:
        if img.format not in limits.formats:
            raise ValueError(
                f"{where}: image format {img.format} is not accepted; use one of "
                f"{', '.join(limits.formats)}"
            )
        header = ImageHeader(img.format, img.width, img.height)
    check_image_pixels(header.width, header.height, limits, where)
    return header


def per_image_bound(limits: PixelLimits) -> int:
    from PIL import Image

    # PIL's own bomb threshold (its warning) stays a bound whatever the flag says
    return min(limits.max_pixels, Image.MAX_IMAGE_PIXELS or limits.max_pixels)


def check_image_pixels(width: int, height: int, limits: PixelLimits, where: str) -> None:
    bound = per_image_bound(limits)
    if width * height > bound:
        raise ValueError(
            f"{where}: image has {width}x{height} = {width * height:,} pixels "
            f"({_mb(width * height)} as RGB), more than the {bound:,} allowed per image"
        )


def check_request_pixels(images: Iterable[Charged], limits: PixelLimits) -> int:
    """The decoded pixels of a request's images, before any is decoded; ``ValueError`` naming
    the part whose image takes the total past the per-request bound."""
    total = 0
    for image in images:
        if image.header is None:
            continue
        total += image.header.pixels
        if total > limits.max_pixels_per_request:
            raise ValueError(
                f"{image.where}: the request's images up to this one decode to {total:,} "
                f"pixels ({_mb(total)} as RGB), more than the "
                f"{limits.max_pixels_per_request:,} allowed per request"
            )
    return total


def decode_rgb(raw: bytes, header: ImageHeader, limits: PixelLimits, where: str):
    """The first frame of ``raw`` (which passed ``probe``) as an RGB PIL image."""
    with _open(raw, limits, where) as img:
        # the same bytes parse to the same header; anything else is a bug, not a client error
        assert img.size == (header.width, header.height), (img.size, header)
        try:
            return img.convert("RGB")
        except Exception as exc:  # truncated data, corrupt streams: PIL raises many kinds
            raise _undecodable(where, exc) from exc


def webp_canvas(raw: bytes) -> tuple[int, int] | None:
    """A WebP's canvas size from its RIFF header (VP8X, VP8L or VP8 first chunk), else None."""
    if raw[:4] != b"RIFF" or raw[8:12] != b"WEBP" or len(raw) < 30:
        return None
    chunk = raw[12:16]
    if chunk == b"VP8X":
        return 1 + int.from_bytes(raw[24:27], "little"), 1 + int.from_bytes(raw[27:30], "little")
    if chunk == b"VP8L" and raw[20] == 0x2F:
        bits = int.from_bytes(raw[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and raw[23:26] == b"\x9d\x01\x2a":
        width, height = int.from_bytes(raw[26:28], "little"), int.from_bytes(raw[28:30], "little")
        return width & 0x3FFF, height & 0x3FFF
    return None


def _open(raw: bytes, limits: PixelLimits, where: str):
    from PIL import Image

    try:
        return Image.open(io.BytesIO(raw), formats=PIL_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # PIL's check ran on the header's size (the warning only when raised as an error)
        raise ValueError(
            f"{where}: image has more than the {per_image_bound(limits):,} pixels allowed per "
            f"image (a decompression bomb by PIL's own limit)"
        ) from exc
    except Image.UnidentifiedImageError:
        raise ValueError(
            f"{where}: not a decodable image (not a {', '.join(limits.formats)} file)"
        ) from None
    except Exception as exc:  # a header PIL cannot parse: it raises many kinds
        raise _undecodable(where, exc) from exc


def _undecodable(where: str, exc: Exception) -> ValueError:
    reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
    return ValueError(f"{where}: not a decodable image ({reason})")


def _mb(pixels: int) -> str:
    return f"{pixels * RGB_BYTES / 1e6:,.0f} MB"
