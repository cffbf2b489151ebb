"""Bounded walks over an image file's structure, before PIL parses it.

PIL parses PNG chunks, JPEG markers and GIF blocks in Python, one loop turn each (JPEG
fill bytes and GIF junk bytes one turn per byte). A file of nothing else costs more CPU to
parse than any image of its size costs to decode: 15 MB of JPEG fill bytes kept PIL's
``Image.open`` busy for 8.5 s, 1.5 M empty PNG chunks 3-5 s, 3 M GIF comment blocks 1.8 s.
A real image needs a few dozen turns (a 20 MB PNG in libpng's 8 KB IDAT chunks: 2,560), so
a file needing more than ``MAX_TURNS`` is refused after at most that many turns here.
"""

from __future__ import annotations

MAX_TURNS = 16_384


def check_structure(raw: bytes, where: str) -> None:
    """``ValueError`` naming ``where`` when PIL would loop more than ``MAX_TURNS`` times over
    ``raw``'s chunks, markers or blocks (PNG, JPEG, GIF; other formats parse in C)."""
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        turns, pieces = _png_turns(raw), "chunks"
    elif raw.startswith(b"\xff\xd8\xff"):
        turns, pieces = _jpeg_turns(raw), "markers and fill bytes before the image data"
    elif raw[:6] in (b"GIF87a", b"GIF89a"):
        turns, pieces = _gif_turns(raw), "blocks before the first frame's data"
    else:
        return
    if turns > MAX_TURNS:
        raise ValueError(f"{where}: not a decodable image (more than {MAX_TURNS:,} {pieces})")


def _png_turns(raw: bytes) -> int:
    """Chunks up to IEND (PIL reads every one of them, before and after the image data)."""
    pos, turns = 8, 0
    while pos + 8 <= len(raw) and turns <= MAX_TURNS:
        turns += 1
        if raw[pos + 4 : pos + 8] == b"IEND":
            break
        pos += 12 + int.from_bytes(raw[pos : pos + 4], "big")  # length, type, data, CRC
    return turns


def _jpeg_turns(raw: bytes) -> int:
    """Turns of PIL's marker loop up to the start of scan (libjpeg, in C, does the rest)."""
    pos, turns = 2, 0
    while pos + 1 < len(raw) and turns <= MAX_TURNS:
        turns += 1
        marker = raw[pos + 1]
        if raw[pos] != 0xFF or marker in (0x00, 0xFF):  # junk, an escaped or a fill byte
            pos += 1
        elif marker == 0xDA:
            break
        elif marker == 0xC8 or 0xD0 <= marker <= 0xD9 or 0xF0 <= marker <= 0xFD:
            pos += 2  # markers PIL reads no length for
        else:
            pos += 2 + int.from_bytes(raw[pos + 2 : pos + 4], "big")
    return turns


def _gif_turns(raw: bytes) -> int:
    """Blocks and sub-blocks (and stray bytes) up to the first image descriptor."""
    flags = raw[10] if len(raw) > 10 else 0
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # screen, global palette
    turns = 0
    while pos < len(raw) and turns <= MAX_TURNS:
        turns += 1
        block = raw[pos]
        if block in (0x2C, 0x3B):  # an image descriptor, the trailer
            break
        if block != 0x21:  # PIL skips a stray byte per turn
            pos += 1
            continue
        pos += 2  # introducer, label
        while pos < len(raw) and raw[pos] and turns <= MAX_TURNS:
            turns += 1
            pos += 1 + raw[pos]
        pos += 1  # the terminating empty sub-block
    return turns
