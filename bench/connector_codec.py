"""The stored-value codec alone (no store): what format v2's key and checksum cost.

For each block geometry, whole blocks are encoded from a paged cache and decoded back into
another cache's slots, in memory, by the codec (format v2: header names the key, xxh3-128 of
the data verified before the copy), side by side in the same run with a copy of format v1's
work (the same header without key and checksum, parsed and checked the same way, one copy
each way), and with the bare checksums (xxh3-128, and blake3 for the record). MB/s count
tensor payload bytes (1 MB = 1e6 B). Run through ``bench/connector.py --codec``.
"""

from __future__ import annotations

import json
import struct
import time

import blake3
import numpy as np
import torch
import xxhash

from epdserve.connectors.storage.codec import DTYPE_CODES, dtype_name
from epdserve.connectors.storage.kv_codec import KVBlockMeta, decode_kv_block, encode_kv_block


def v1_encode(tensor: torch.Tensor, metadata: dict[str, str]) -> bytes:
    """Format v1's encoder: header without key or checksum, one copy of the data."""
    header = {
        "__metadata__": {**metadata, "version": "1", "dtype": dtype_name(tensor.dtype)},
        "kv": {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [0, tensor.nbytes],
        },
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
    return b"".join((struct.pack("<Q", len(raw)), raw, data))


def v1_decode(data: bytes, metadata: dict[str, str], out: torch.Tensor) -> bool:
    """Format v1's decoder: parse and check the header, one copy into ``out``."""
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(bytes(data[8 : 8 + size]))
    stored, entry = header["__metadata__"], header["kv"]
    expected = {**metadata, "version": "1", "dtype": dtype_name(out.dtype)}
    if any(stored.get(k) != v for k, v in expected.items()):
        return False
    nbytes = out.nbytes
    if entry["shape"] != list(out.shape) or entry["data_offsets"] != [0, nbytes]:
        return False
    if len(data) != 8 + size + nbytes:
        return False
    dst = out.view(-1).view(torch.uint8).numpy()
    np.copyto(dst, np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=8 + size))
    return True


def _best(cases: dict, repeats: int) -> dict[str, float]:
    """Best time of each case, run round-robin so drift on a shared CPU hits all alike."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def codec_case(shape: tuple[int, ...], total_bytes: int, repeats: int) -> dict:
    """Encode/decode MB/s of formats v2 and v1 and of the bare checksums for one geometry."""
    meta = KVBlockMeta("bench-model", shape[2], "sha256_cbor", shape[3])
    block_bytes = torch.empty(shape, dtype=torch.bfloat16).nbytes
    n = max(8, total_bytes // block_bytes)
    source = torch.randn(n, *shape).to(torch.bfloat16)
    dest = torch.zeros_like(source)
    keys = [f"epd:kv:bench:{meta.fingerprint}:{i:064x}" for i in range(n)]
    v2 = [encode_kv_block(source[i], meta, keys[i]) for i in range(n)]
    v1 = [v1_encode(source[i], meta.to_metadata()) for i in range(n)]
    payloads = [memoryview(source[i].view(-1).view(torch.uint8).numpy()) for i in range(n)]
    shape_, dtype = tuple(shape), torch.bfloat16

    def v2_load():
        for i in range(n):
            assert (
                decode_kv_block(v2[i], meta, shape_, dtype, keys[i], out=dest[i]).tensor is not None
            )

    def v1_load():
        for i in range(n):
            assert v1_decode(v1[i], meta.to_metadata(), dest[i])

    cases = {
        "v2_encode": lambda: [encode_kv_block(source[i], meta, keys[i]) for i in range(n)],
        "v1_encode": lambda: [v1_encode(source[i], meta.to_metadata()) for i in range(n)],
        "v2_decode": v2_load,
        "v1_decode": v1_load,
        "xxh3_128": lambda: [xxhash.xxh3_128_hexdigest(p) for p in payloads],
        "blake3": lambda: [blake3.blake3(p).hexdigest() for p in payloads],
    }
    t = _best(cases, repeats)
    v2_load()
    assert torch.equal(dest.view(torch.int16), source.view(torch.int16))
    total = n * block_bytes
    out = {"block_bytes": block_bytes, "blocks": n}
    out.update({f"{name}_MBps": round(total / s / 1e6, 1) for name, s in t.items()})
    out["encode_v2_vs_v1"] = round(t["v1_encode"] / t["v2_encode"], 3)
    out["decode_v2_vs_v1"] = round(t["v1_decode"] / t["v2_decode"], 3)
    out["header_bytes_v1_v2"] = [len(v1[0]) - block_bytes, len(v2[0]) - block_bytes]
    return out


def codec_figures(geometries: dict, total_bytes: int, repeats: int) -> dict:
    torch.manual_seed(0)
    return {name: codec_case(shape, total_bytes, repeats) for name, shape in geometries.items()}
