"""Stored-tensor codec: one named tensor + string metadata as safetensors bytes.

Encoding writes the safetensors layout directly (8-byte little-endian header length, JSON
header padded to 8 bytes, raw little-endian data) so the tensor is copied exactly once, into
the value. Decoding parses and checks the header strictly and copies the data straight into
the caller's destination (e.g. the cache's block slot). Anything unexpected -- truncated,
oversized, wrong metadata, shape or dtype -- decodes to ``None`` (a miss), never an error.
"""

from __future__ import annotations

import json
import logging
import struct
import warnings
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
KV_LAYOUT = "layer,kv,token,head,dim"  # one block of [blocks, layers, 2, block_size, heads, dim]
KV_TENSOR = "kv"
EC_TENSOR = "embedding"
MAX_HEADER_BYTES = 64 * 1024

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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form stored in metadata)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVBlockMeta:
    """What a stored KV block must agree on with its reader (besides shape and dtype)."""

    fingerprint: str
    block_size: int
    hash_algo: str
    layout: str = KV_LAYOUT
    version: int = FORMAT_VERSION

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": "epd-kv",
            "version": str(self.version),
            "fingerprint": self.fingerprint,
            "layout": self.layout,
            "block_size": str(self.block_size),
            "hash_algo": self.hash_algo,
        }


@dataclass(frozen=True)
class EncoderOutputMeta:
    """What a stored encoder output must agree on with its reader (besides shape and dtype)."""

    fingerprint: str
    version: int = FORMAT_VERSION

    def to_metadata(self) -> dict[str, str]:
        return {"format": "epd-ec", "version": str(self.version), "fingerprint": self.fingerprint}


def encode_kv_block(tensor: torch.Tensor, meta: KVBlockMeta) -> bytes:
    """Safetensors bytes of one block's cross-layer span ``[layers, 2, block, heads, dim]``."""
    return encode_tensor(KV_TENSOR, tensor, meta.to_metadata())


def decode_kv_block(
    data: bytes | memoryview | None,
    expected_meta: KVBlockMeta,
    expected_shape: tuple[int, ...],
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The block as a tensor (``out`` itself when given), or ``None`` if it does not match."""
    return decode_tensor(data, KV_TENSOR, expected_meta.to_metadata(), expected_shape, dtype, out)


def encode_encoder_output(tensor: torch.Tensor, meta: EncoderOutputMeta) -> bytes:
    """Safetensors bytes of one multimodal item's embedding tensor."""
    return encode_tensor(EC_TENSOR, tensor, meta.to_metadata())


def decode_encoder_output(
    data: bytes | memoryview | None,
    expected_meta: EncoderOutputMeta,
    expected_shape: tuple[int, ...],
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The embedding (``out`` itself when given), or ``None`` if it does not match."""
    return decode_tensor(data, EC_TENSOR, expected_meta.to_metadata(), expected_shape, dtype, out)


def encode_tensor(name: str, tensor: torch.Tensor, metadata: dict[str, str]) -> bytes:
    """Safetensors bytes holding ``tensor`` under ``name``; metadata gains its ``dtype``."""
    if tensor.dtype not in DTYPE_CODES:
        raise ValueError(f"tensor dtype {tensor.dtype} cannot be stored")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    header = {
        "__metadata__": {**metadata, "dtype": dtype_name(tensor.dtype)},
        name: {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [0, tensor.nbytes],
        },
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    data = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.nbytes else b""
    return b"".join((struct.pack("<Q", len(raw)), raw, data))


def decode_tensor(
    data: bytes | memoryview | None,
    name: str,
    metadata: dict[str, str],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Check ``data`` against everything expected and copy its tensor out, else ``None``."""
    shape = tuple(int(s) for s in shape)
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype):
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected {shape} {dtype}")
    if data is None:
        return None
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    offset = _check_header(data, name, {**metadata, "dtype": dtype_name(dtype)}, shape, dtype)
    if offset is None or len(data) != offset + nbytes:
        return None
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    if not nbytes:
        return out
    if out.device.type == "cpu" and out.is_contiguous():
        # A plain memcpy: torch's copy_ splits >64K-element copies over OpenMP threads, which
        # is slower than one core when the engine's own threads are busy.
        dst = out.view(-1).view(torch.uint8).numpy()
        np.copyto(dst, np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=offset))
    else:
        out.copy_(torch.frombuffer(data, dtype=dtype, count=numel, offset=offset).view(shape))
    return out


def _check_header(data, name, metadata, shape, dtype) -> int | None:
    """Offset of the tensor data when the header is sane and matches, else ``None``."""
    if len(data) < 8:
        return None
    (size,) = struct.unpack_from("<Q", data)
    if not 2 <= size <= MAX_HEADER_BYTES or 8 + size > len(data):
        return None
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(header, dict) or set(header) != {"__metadata__", name}:
        return None
    stored_meta, entry = header["__metadata__"], header[name]
    if not isinstance(stored_meta, dict) or not isinstance(entry, dict):
        return None
    if any(stored_meta.get(k) != v for k, v in metadata.items()):
        return None
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if (
        entry.get("dtype") != DTYPE_CODES.get(dtype)
        or entry.get("shape") != list(shape)
        or entry.get("data_offsets") != [0, nbytes]
    ):
        return None
    return 8 + size
