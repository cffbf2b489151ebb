"""The codec refuses every damaged, cut, padded, mislabelled or crafted value with a reason,
and never raises on one; what it accepts is bit for bit what was stored."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch

from epdserve.connectors.storage import KVBlockMeta, decode_kv_block, encode_kv_block
from epdserve.connectors.storage.codec import (
    MAX_HEADER_BYTES,
    REJECT_REASONS,
    encode_tensor,
    payload_checksum,
)
from epdserve.connectors.storage.header import nesting_within

BLOCK = (2, 2, 4, 2, 8)
KEY = "epd:kv:pool:tiny-llama-0123:ab01"
OTHER_KEY = "epd:kv:pool:tiny-llama-0123:ab02"
NBYTES = 4 * 2 * 2 * 4 * 2 * 8


def block() -> torch.Tensor:
    return torch.arange(NBYTES // 4, dtype=torch.float32).view(BLOCK)


def valid(meta: KVBlockMeta, key: str = KEY) -> bytes:
    return encode_kv_block(block(), meta, key)


def header_of(data: bytes) -> dict:
    (size,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + size])


def with_header(header: dict | bytes, body: bytes = b"\0" * NBYTES) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def rewritten(meta: KVBlockMeta, **changes) -> bytes:
    """A valid value whose header metadata is changed (``None`` drops a field)."""
    data = valid(meta)
    header = header_of(data)
    for name, value in changes.items():
        header["__metadata__"].pop(name, None)
        if value is not None:
            header["__metadata__"][name] = value
    return with_header(header, data[-NBYTES:])


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def flipped(data: bytes, offset: int) -> bytes:
    """One bit flipped (the lowest: a hex digit stays a character JSON takes in a string)."""
    out = bytearray(data)
    out[offset] ^= 0x01
    return bytes(out)


DAMAGE = {  # name -> (value from meta, the reason it must be refused for)
    "empty": (lambda m: b"", "not_safetensors"),
    "shorter than a header length": (lambda m: b"\x01\x02\x03", "not_safetensors"),
    "random bytes": (lambda m: bytes(range(256)) * 20, "header_too_large"),
    "truncated by one byte": (lambda m: valid(m)[:-1], "truncated"),
    "cut inside the header": (lambda m: valid(m)[:100], "not_safetensors"),
    "one byte too long": (lambda m: valid(m) + b"\0", "oversized"),
    "a megabyte too long": (lambda m: valid(m) + bytes(1 << 20), "oversized"),
    "header length 2**62": (
        lambda m: struct.pack("<Q", 1 << 62) + valid(m)[8:],
        "header_too_large",
    ),
    "header past the end": (lambda m: struct.pack("<Q", 1024) + b"{}", "not_safetensors"),
    "huge header JSON": (
        lambda m: with_header(b'{"x":"' + b"a" * MAX_HEADER_BYTES + b'"}'),
        "header_too_large",
    ),
    # 10,000 deep does not fit in a header: refused by its length before anything is parsed
    "header nested 10,000 deep": (lambda m: with_header(deep(10_000)), "header_too_large"),
    "header nested 8,000 deep": (lambda m: with_header(deep(8_000)), "too_deep"),
    "10,000 unclosed brackets": (lambda m: with_header(b"[" * 10_000), "too_deep"),
    "tensor entry nested 5,000 deep": (
        lambda m: with_header(b'{"__metadata__":{},"kv":' + deep(5_000) + b"}"),
        "too_deep",
    ),
    "objects nested 2,500 deep": (
        lambda m: with_header(b'{"a":' * 2_500 + b"1" + b"}" * 2_500),
        "too_deep",
    ),
    "shape nested one level too deep": (
        lambda m: with_header({"__metadata__": {}, "kv": {"shape": [[4]]}}),
        "too_deep",
    ),
    "header not JSON": (lambda m: with_header(b"{not json" + b" " * 7), "not_safetensors"),
    "header not UTF-8": (lambda m: with_header(b"\xff\xfe\xfd\xfc"), "not_safetensors"),
    "header a list": (lambda m: with_header([1, 2]), "not_safetensors"),
    "a 5,000-digit number": (
        lambda m: with_header(b'{"__metadata__":{},"kv":{"shape":[' + b"9" * 5000 + b"]}}"),
        "not_safetensors",
    ),
    "an extra tensor": (
        lambda m: with_header(
            {
                "__metadata__": {},
                "kv": {},
                "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            }
        ),
        "not_safetensors",
    ),
    "metadata not a map": (
        lambda m: with_header({"__metadata__": "x", "kv": {}}),
        "not_safetensors",
    ),
    "metadata not all strings": (lambda m: rewritten(m, block_size=4), "not_safetensors"),
    "format version 1": (lambda m: rewritten(m, version="1"), "format"),
    "an encoder output": (lambda m: rewritten(m, format="epd-ec"), "format"),
    "no key": (lambda m: rewritten(m, key=None), "key"),
    "the header names another key": (lambda m: valid(m, OTHER_KEY), "key"),
    "another model": (lambda m: rewritten(m, fingerprint="other-model"), "metadata"),
    "another dtype in metadata": (lambda m: rewritten(m, dtype="bfloat16"), "dtype_shape"),
    "offsets shifted": (
        lambda m: with_header(
            {
                "__metadata__": {**m.to_metadata(), "dtype": "float32", "key": KEY},
                "kv": {"dtype": "F32", "shape": list(BLOCK), "data_offsets": [4, 4 + NBYTES]},
            },
            b"\0" * (4 + NBYTES),
        ),
        "dtype_shape",
    ),
    "a bit flipped in the data": (lambda m: flipped(valid(m), -100), "checksum"),
    "a bit flipped in the checksum": (
        lambda m: flipped(valid(m), valid(m).index(b"xxh3_128:") + 12),
        "checksum",
    ),
    "no checksum": (lambda m: rewritten(m, checksum=None), "checksum"),
    "another checksum algorithm": (
        lambda m: rewritten(m, checksum="blake3:" + "0" * 64),
        "checksum",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_value_is_refused_with_its_reason(case, meta):
    make, reason = DAMAGE[case]
    dest = torch.zeros(BLOCK)
    assert decode_kv_block(make(meta), meta, BLOCK, torch.float32, KEY, out=dest) == (None, reason)
    assert dest.count_nonzero() == 0  # a refused value never touches the destination


def test_every_reason_is_exercised_by_the_table():
    assert {reason for _, reason in DAMAGE.values()} == set(REJECT_REASONS)


def test_random_single_byte_damage_never_raises_and_never_decodes_to_other_data(meta):
    data, rng = valid(meta), random.Random(5)
    accepted = 0
    for _ in range(2000):
        damaged = bytearray(data)
        damaged[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        tensor, reason = decode_kv_block(bytes(damaged), meta, BLOCK, torch.float32, KEY)
        if tensor is not None:  # only harmless bytes (header padding) may change
            accepted += 1
            assert torch.equal(tensor, block()) and reason == ""
        else:
            assert reason in REJECT_REASONS
    assert accepted < 2000 * 0.05


def test_brackets_inside_strings_do_not_count_as_nesting(meta):
    extra = {**meta.to_metadata(), "key": KEY, "note": "[{" * 2000 + '"\\"['}
    data = encode_tensor("kv", block(), extra)
    assert torch.equal(decode_kv_block(data, meta, BLOCK, torch.float32, KEY).tensor, block())
    assert nesting_within(b'{"a": "[[[[{{{{", "b": [1, {"c": 2}]}', 3)
    assert not nesting_within(b'{"a": [[[1]]]}', 3)


def test_the_checksum_covers_the_data_exactly():
    data = block().view(-1).view(torch.uint8).numpy()
    assert payload_checksum(data) == payload_checksum(bytes(data))
    assert payload_checksum(data) != payload_checksum(bytes(data)[:-1])
