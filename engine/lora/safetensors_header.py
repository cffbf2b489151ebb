"""A safetensors header read from an untrusted file and checked by safetensors' own rules, so
that a file accepted here is one ``safetensors`` itself reads: a known dtype, a shape of
non-negative ints, ``data_offsets`` spanning exactly the shape's bytes in that dtype, and the
spans, in offset order, tiling the data section from its first byte to the file's end.

Every refusal is a ``ValueError`` naming the file and the part (the header's length, its JSON,
``__metadata__``, a tensor's dtype, shape or data_offsets); nothing else escapes for any bytes.
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

from epdserve.connectors.storage.header import nesting_within

MAX_HEADER_BYTES = 64 << 20
HEADER_DEPTH = 3  # {"name": {"shape": [...]}}: a safetensors header never nests deeper
# bits per element of every safetensors dtype (its Dtype::bitsize)
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
    "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip


def read_header(f: BinaryIO, size: int, file_name: str) -> dict:
    """The header (name -> dtype, shape, data_offsets; ``__metadata__`` kept) of the
    ``size``-byte safetensors file open as ``f``, at its start."""
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
        raise _malformed(file_name, "bad header length")
    text = f.read(n)
    if len(text) != n or not text.startswith(b"{"):
        raise _malformed(file_name, "the header is not a JSON object")
    header = parse_json(text, f"{file_name}: malformed header", HEADER_DEPTH)
    if not isinstance(header, dict):
        raise _malformed(file_name, "the header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise _malformed(file_name, "__metadata__ is not a map of strings")
    data_size = size - 8 - n
    spans = sorted(
        (_span(file_name, name, entry, data_size), name)
        for name, entry in header.items()
        if name != "__metadata__"
    )
    end = 0
    for (begin, stop), name in spans:
        if begin != end:  # safetensors' InvalidOffset: a gap or an overlap
            raise _malformed(
                file_name,
                f"tensor {clip(repr(name))}: data_offsets start at {begin}, where the "
                f"tensors before it end at {end}",
            )
        end = stop
    if end != data_size:
        raise _malformed(
            file_name, f"the tensors end at byte {end} of a {data_size}-byte data section"
        )
    return header


def _span(file_name: str, name: str, entry, data_size: int) -> tuple[int, int]:
    """One entry's ``data_offsets``, checked against its dtype and shape."""
    where = f"tensor {clip(repr(name))}"
    if not isinstance(entry, dict):
        raise _malformed(file_name, f"{where} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _malformed(
            file_name, f"{where}: dtype {clip(repr(dtype))} is not a safetensors dtype"
        )
    if not _sizes(shape):
        raise _malformed(file_name, f"{where}: shape {clip(repr(shape))} is not a list of sizes")
    if not _sizes(offsets) or len(offsets) != 2:
        raise _malformed(
            file_name, f"{where}: data_offsets {clip(repr(offsets))} are not two offsets"
        )
    begin, end = offsets
    if not begin <= end <= data_size:
        raise _malformed(
            file_name,
            f"{where}: data_offsets [{begin}, {end}] are not within the {data_size}-byte "
            "data section",
        )
    if _bits(shape, DTYPE_BITS[dtype], 8 * data_size) != 8 * (end - begin):
        raise _malformed(
            file_name,
            f"{where}: {dtype} of shape {clip(str(shape))} does not fill data_offsets "
            f"[{begin}, {end}] ({end - begin} bytes)",
        )
    return begin, end


def _sizes(value) -> bool:
    """Whether ``value`` is a list of what safetensors reads as ``usize`` (bools are not)."""
    return isinstance(value, list) and all(type(v) is int and 0 <= v < 1 << 64 for v in value)


def _bits(shape: list[int], bits: int, limit: int) -> int:
    """Bits of a tensor of ``shape``; stops multiplying past ``limit`` (a shape of a million
    huge sizes would otherwise cost a huge product)."""
    if 0 in shape:
        return 0
    for size in shape:
        bits *= size
        if bits > limit:
            break
    return bits


def parse_json(data: bytes, what: str, depth: int):
    """JSON of UTF-8 ``data`` nested at most ``depth`` deep (measured before parsing, so no
    ``RecursionError``); ``ValueError`` starting with ``what`` (a file, or its part) otherwise."""
    if not nesting_within(data, depth):
        raise ValueError(f"{what}: nested deeper than {depth} levels")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        raise ValueError(f"{what}: not valid JSON ({clip(str(exc))})") from None


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters for a message (names and values come from files
    and requests, and may be megabytes long)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _malformed(file_name: str, detail: str) -> ValueError:
    return ValueError(f"{file_name}: malformed header: {detail}")
