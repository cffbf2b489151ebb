"""Hostile images built in a few milliseconds each: images whose headers promise far more
pixels than their bytes (PNG, JPEG, GIF, WebP), truncated ones, and a GIF of many frames."""

from __future__ import annotations

import base64
import io
import struct
import zlib


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def saved(image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def small(fmt: str = "PNG", size=(48, 32)) -> bytes:
    from PIL import Image

    return saved(Image.new("RGB", size, (10, 120, 200)), fmt)


def png_1bit(width: int, height: int) -> bytes:
    """A real 1-bit PNG, all black: 6300x6300 takes 4.9 KB and decodes to 119 MB of RGB."""
    from PIL import Image

    return saved(Image.new("1", (width, height)), "PNG", optimize=True)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header (valid CRC) claims ``width x height`` RGB pixels over 64 bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


def jpeg_claiming(width: int, height: int) -> bytes:
    """A 16x16 JPEG whose frame header (SOF0) is patched to claim ``width x height``."""
    raw = bytearray(small("JPEG", (16, 16)))
    sof = raw.index(b"\xff\xc0")  # marker, length (2), precision (1), height (2), width (2)
    raw[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(raw)


def gif(width: int, height: int, frames: int, first=(0, 0, 1, 1)) -> bytes:
    """An animated GIF: a ``width x height`` screen and ``frames`` frames of one pixel each
    (``first`` is frame 0's left, top, width, height), about 24 bytes a frame."""
    screen = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    loop = b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"

    def frame(left, top, w, h):  # graphic control, descriptor, 2-bit LZW data for one pixel
        control = b"\x21\xf9\x04\x00\x00\x00\x00\x00"
        return (
            control + b"\x2c" + struct.pack("<HHHHB", left, top, w, h, 0) + b"\x02\x02\x44\x01\x00"
        )

    return screen + loop + frame(*first) + frame(0, 0, 1, 1) * (frames - 1) + b"\x3b"


def webp_canvas(width: int, height: int) -> bytes:
    """A two-frame 16x16 animated WebP whose canvas (VP8X) is patched to ``width x height``:
    frames may sit anywhere on an animation's canvas, so the file stays valid."""
    from PIL import Image

    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    raw = bytearray(saved(frames[0], "WEBP", save_all=True, append_images=frames[1:]))
    assert raw[12:16] == b"VP8X"
    raw[24:27], raw[27:30] = (width - 1).to_bytes(3, "little"), (height - 1).to_bytes(3, "little")
    return bytes(raw)


def truncated(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


# Parser bombs: pieces PIL parses one Python loop turn each, and nothing else.
def png_chunks(count: int) -> bytes:
    """A 48x32 PNG with ``count`` empty ancillary chunks after its header (12 bytes each)."""
    raw = small("PNG")
    return raw[:33] + png_chunk(b"teSt", b"") * count + raw[33:]


def jpeg_fill(count: int) -> bytes:
    """A 48x32 JPEG with ``count`` 0xFF fill bytes before its first marker segment."""
    raw = small("JPEG")
    return raw[:2] + b"\xff" * count + raw[2:]


def gif_comments(count: int) -> bytes:
    """A one-frame GIF with ``count`` one-byte comment extensions before the frame."""
    raw = gif(48, 32, 1)
    frame = raw.index(b"\x21\xf9")  # the frame's graphic control extension
    return raw[:frame] + b"\x21\xfe\x01x\x00" * count + raw[frame:]
