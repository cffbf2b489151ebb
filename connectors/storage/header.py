"""Reads the header of a one-tensor safetensors value from untrusted bytes, within bounds.

A value read from Redis or a shared volume may be anything: truncated, random, or crafted.
The header's length is checked before any byte of it is parsed, its nesting is measured
without recursion before ``json.loads`` sees it (a 10,000-deep array would otherwise raise
``RecursionError`` from inside the parser), and its shape must be exactly the one the format
needs. Every refusal is a ``BadValue`` carrying a reason the caller counts. (A repeated name in
an object keeps its last value, as in ``json``: only this parsed view is ever used, and every
field of it that matters is checked.)
"""

from __future__ import annotations

import json
import struct

MAX_HEADER_BYTES = 16 * 1024  # ours are < 1.5 KiB (the longest key is about 800 characters)
MAX_DEPTH = 3  # {"name": {"shape": [...]}}: the format never nests deeper

# reasons a value is refused at this level
NOT_SAFETENSORS = "not_safetensors"
HEADER_TOO_LARGE = "header_too_large"
TOO_DEEP = "too_deep"

_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


class BadValue(Exception):
    """A stored value that cannot be used; ``reason`` names why (a metric label)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def read_header(data: bytes | memoryview, name: str) -> tuple[dict[str, str], dict, int]:
    """``(metadata, tensor entry, data offset)`` of a value holding one tensor ``name``.

    Raises ``BadValue`` when the bytes are not such a safetensors value; never anything else.
    """
    if len(data) < 8:
        raise BadValue(NOT_SAFETENSORS)
    (size,) = struct.unpack_from("<Q", data)
    if size > MAX_HEADER_BYTES:
        raise BadValue(HEADER_TOO_LARGE)
    if size < 2 or 8 + size > len(data):
        raise BadValue(NOT_SAFETENSORS)
    raw = bytes(data[8 : 8 + size])
    if not nesting_within(raw, MAX_DEPTH):
        raise BadValue(TOO_DEEP)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError included
        raise BadValue(NOT_SAFETENSORS) from None
    if not isinstance(header, dict) or set(header) != {"__metadata__", name}:
        raise BadValue(NOT_SAFETENSORS)
    metadata, entry = header["__metadata__"], header[name]
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadValue(NOT_SAFETENSORS)  # safetensors metadata is a str -> str map
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise BadValue(NOT_SAFETENSORS)
    return metadata, entry, 8 + size


def nesting_within(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays/objects at most ``limit`` deep, measured
    without recursion; brackets inside string literals do not count. Escaped backslashes and
    quotes are dropped first (left to right, as a JSON lexer pairs them), so every remaining
    quote opens or closes a string. Where the text is not JSON the count may differ from a
    parser's, but only after the point where the parser stops with an error."""
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(plain.split(b'"')[::2])  # even pieces lie outside string literals
    depth = 0
    for byte in outside.translate(None, _NOT_BRACKET):
        if byte in b"[{":
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True
