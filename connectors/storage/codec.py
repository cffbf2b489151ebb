"""Stored-tensor codec: one named tensor + string metadata as safetensors bytes.

Encoding writes the safetensors layout directly (8-byte little-endian header length, JSON
header padded to 8 bytes, raw little-endian data) so the tensor is copied exactly once, into
the value. The header's metadata names the value's own storage key and an xxh3-128 checksum
of the data, so a value that was damaged, cut, or stored under another key is told apart
from a good one. Decoding parses the header within bounds (``header.read_header``), checks
everything against what the reader expects, verifies the checksum and only then copies the
data into the caller's destination (e.g. the cache's block slot). A value that does not pass
decodes to ``Decoded(None, reason)`` -- a miss with a reason to count -- never an error.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from epdserve.connectors.storage.header import (
    HEADER_TOO_LARGE,
    MAX_HEADER_BYTES,
    NOT_SAFETENSORS,
    TOO_DEEP,
    BadValue,
    read_header,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: the metadata names the value's key and a checksum of its data
EC_TENSOR = "embedding"
# Not a cryptographic hash on purpose: whoever can write to the store can write any unkeyed
# digest too, so this guards against damage and mix-ups, where xxh3 is ~6x faster than blake3.
CHECKSUM_ALGO = "xxh3_128"

# why a stored value was refused (the ``reason`` label of the rejection counter)
FORMAT = "format"  # another format or format version
KEY = "key"  # the header names another key: the value was stored or copied under ours
METADATA = "metadata"  # another model, layout, block size, head count, head or hash algorithm
DTYPE_SHAPE = "dtype_shape"  # another dtype or shape than the reader's
TRUNCATED = "truncated"  # shorter than its header says
OVERSIZED = "oversized"  # longer than its header says
CHECKSUM = "checksum"  # the data does not match its checksum (damaged bytes)
REJECT_REASONS = (
    NOT_SAFETENSORS,
    HEADER_TOO_LARGE,
    TOO_DEEP,
    FORMAT,
    KEY,
    METADATA,
    DTYPE_SHAPE,
    TRUNCATED,
    OVERSIZED,
    CHECKSUM,
)

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

# torch warns once per process that a tensor over immutable bytes is not writable; we only
# read from such views, so consume that one-time warning here instead of in a caller's log.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0" * 8, dtype=torch.uint8)


class Decoded(NamedTuple):
    """A decoded tensor, or ``None`` and the reason the value was refused."""

    tensor: torch.Tensor | None
    reason: str = ""  # "" when decoded, else one of REJECT_REASONS


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form stored in metadata)."""
    return str(dtype).removeprefix("torch.")


def payload_checksum(data) -> str:
    """``"xxh3_128:<32 hex digits>"`` of a buffer (the form stored in metadata)."""
    return f"{CHECKSUM_ALGO}:{xxhash.xxh3_128_hexdigest(data)}"


@dataclass(frozen=True)
class EncoderOutputMeta:
    """What a stored encoder output must agree on with its reader (besides key, shape, dtype)."""

    fingerprint: str
    version: int = FORMAT_VERSION

    def to_metadata(self) -> dict[str, str]:
        return {"format": "epd-ec", "version": str(self.version), "fingerprint": self.fingerprint}


def encode_encoder_output(tensor: torch.Tensor, meta: EncoderOutputMeta, key: str) -> bytes:
    """Safetensors bytes of one multimodal item's embedding tensor, to be stored under ``key``."""
    return encode_tensor(EC_TENSOR, tensor, {**meta.to_metadata(), "key": key})


def decode_encoder_output(
    data: bytes | memoryview,
    expected_meta: EncoderOutputMeta,
    expected_shape: tuple[int, ...],
    dtype: torch.dtype,
    key: str,
    out: torch.Tensor | None = None,
) -> Decoded:
    """The embedding read from ``key`` (into ``out`` when given), or why it was refused."""
    metadata = {**expected_meta.to_metadata(), "key": key}
    return decode_tensor(data, EC_TENSOR, metadata, expected_shape, dtype, out)


def encode_tensor(name: str, tensor: torch.Tensor, metadata: dict[str, str]) -> bytes:
    """Safetensors bytes holding ``tensor`` under ``name``; metadata gains its ``dtype`` and
    the ``checksum`` of its data."""
    if tensor.dtype not in DTYPE_CODES:
        raise ValueError(f"tensor dtype {tensor.dtype} cannot be stored")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    data = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.nbytes else b""
    header = {
        "__metadata__": {
            **metadata,
            "dtype": dtype_name(tensor.dtype),
            "checksum": payload_checksum(data),
        },
        name: {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [0, tensor.nbytes],
        },
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    return b"".join((struct.pack("<Q", len(raw)), raw, data))


def decode_tensor(
    data: bytes | memoryview,
    name: str,
    metadata: dict[str, str],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> Decoded:
    """Check ``data`` against everything expected (``metadata`` includes the key) and its
    checksum, then copy its tensor out; else ``Decoded(None, reason)``, ``out`` untouched."""
    shape = tuple(int(s) for s in shape)
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype):
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected {shape} {dtype}")
    payload, reason = check_tensor(data, name, metadata, shape, dtype)
    if payload is None:
        return Decoded(None, reason)
    out = out if out is not None else torch.empty(shape, dtype=dtype)
    copy_payload(payload, out)
    return Decoded(out)


def check_tensor(
    data: bytes | memoryview, name: str, metadata: dict[str, str], shape, dtype: torch.dtype
) -> tuple[memoryview | None, str]:
    """``(payload, "")``: a view of the tensor's bytes in ``data`` (nothing copied) when the
    value is the one expected, whole, and matches its checksum; else ``(None, reason)``."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        offset = _check(data, name, metadata, shape, dtype, nbytes)
    except BadValue as exc:
        return None, exc.reason
    return memoryview(data)[offset : offset + nbytes], ""


def copy_payload(payload: memoryview, out: torch.Tensor) -> None:
    """A checked payload into ``out`` (its shape and dtype). On the CPU, with ``out``'s last
    dim contiguous, a plain (strided) memcpy: torch's ``copy_`` splits >64K-element copies
    over OpenMP threads, which is slower than one core when the engine's threads are busy."""
    if not out.numel():
        return
    if out.device.type == "cpu" and out.stride(-1) == 1:
        dst = out.view(torch.uint8).numpy()
        np.copyto(dst, np.frombuffer(payload, dtype=np.uint8).reshape(dst.shape))
    else:
        out.copy_(torch.frombuffer(payload, dtype=out.dtype).view(out.shape))


def _check(data, name, metadata, shape, dtype, nbytes) -> int:
    """Offset of the tensor data when the value is whole and is the one expected; cheap
    checks first, the checksum (a pass over the data) last."""
    stored, entry, offset = read_header(data, name)
    if stored.get("format") != metadata["format"] or stored.get("version") != metadata["version"]:
        raise BadValue(FORMAT)
    if stored.get("key") != metadata["key"]:
        raise BadValue(KEY)
    if any(stored.get(k) != v for k, v in metadata.items()):
        raise BadValue(METADATA)
    if (
        stored.get("dtype") != dtype_name(dtype)
        or entry["dtype"] != DTYPE_CODES.get(dtype)
        or entry["shape"] != list(shape)
        or entry["data_offsets"] != [0, nbytes]
    ):
        raise BadValue(DTYPE_SHAPE)
    if len(data) != offset + nbytes:
        raise BadValue(TRUNCATED if len(data) < offset + nbytes else OVERSIZED)
    if stored.get("checksum") != payload_checksum(memoryview(data)[offset:]):
        raise BadValue(CHECKSUM)
    return offset
