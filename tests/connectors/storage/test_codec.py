"""The stored-tensor codec: bit-exact, safetensors-compatible, and strict on read."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch

from epdserve.connectors.storage import (
    EncoderOutputMeta,
    KVBlockMeta,
    decode_encoder_output,
    decode_kv_block,
    ec_key,
    encode_encoder_output,
    encode_kv_block,
    fingerprint,
    kv_key,
)
from epdserve.connectors.storage.codec import MAX_HEADER_BYTES

BLOCK = (2, 2, 4, 2, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_block_round_trips_bit_exact_into_the_destination_slot(dtype, meta, make_cache):
    cache = make_cache(dtype)
    dest = torch.zeros_like(cache)
    slot = dest[5]
    out = decode_kv_block(encode_kv_block(cache[3], meta), meta, BLOCK, dtype, out=slot)
    assert out is slot and out.data_ptr() == dest[5].data_ptr()
    assert torch.equal(dest[5].view(torch.uint8), cache[3].view(torch.uint8))
    assert dest[[0, 1, 2, 3, 4, 6, 7]].count_nonzero() == 0


def test_without_out_a_fresh_tensor_is_returned(meta, make_cache):
    block = make_cache()[1]
    out = decode_kv_block(encode_kv_block(block, meta), meta, BLOCK, torch.float32)
    assert torch.equal(out, block)


def test_encoded_bytes_are_standard_safetensors_with_the_metadata(meta, make_cache):
    block = make_cache(torch.bfloat16)[2]
    data = encode_kv_block(block, meta)
    assert torch.equal(safetensors.torch.load(data)["kv"], block)
    (size,) = struct.unpack_from("<Q", data)
    stored = json.loads(data[8 : 8 + size])["__metadata__"]
    assert stored == {**meta.to_metadata(), "dtype": "bfloat16"}
    assert {"fingerprint", "dtype", "layout", "block_size", "hash_algo", "version"} <= set(stored)


def test_bytes_written_by_safetensors_itself_decode(meta, make_cache):
    block = make_cache()[4]
    data = safetensors.torch.save({"kv": block}, {**meta.to_metadata(), "dtype": "float32"})
    assert torch.equal(decode_kv_block(data, meta, BLOCK, torch.float32), block)


@pytest.mark.parametrize(
    "other",
    [
        KVBlockMeta("other-model", 4, "sha256_cbor"),
        KVBlockMeta("tiny-llama-0123", 16, "sha256_cbor"),
        KVBlockMeta("tiny-llama-0123", 4, "xxhash_cbor"),
        KVBlockMeta("tiny-llama-0123", 4, "sha256_cbor", layout="kv,layer,token,head,dim"),
        KVBlockMeta("tiny-llama-0123", 4, "sha256_cbor", version=2),
    ],
)
def test_a_metadata_mismatch_is_a_miss(other, meta, make_cache):
    data = encode_kv_block(make_cache()[0], other)
    assert decode_kv_block(data, meta, BLOCK, torch.float32) is None


@pytest.mark.parametrize(
    "shape,dtype",
    [((2, 2, 4, 2, 4), torch.float32), ((1, 2, 4, 2, 8), torch.float32), (BLOCK, torch.bfloat16)],
)
def test_a_shape_or_dtype_mismatch_is_a_miss(shape, dtype, meta, make_cache):
    data = encode_kv_block(make_cache()[0], meta)
    assert decode_kv_block(data, meta, shape, dtype) is None


def _valid(meta) -> bytes:
    return encode_kv_block(torch.ones(BLOCK), meta)


def _with_header(header: dict | bytes, body: bytes = b"\0" * 1024) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


GARBAGE = {
    "empty": lambda m: b"",
    "short": lambda m: b"\x01\x02\x03",
    "random": lambda m: bytes(range(256)) * 20,
    "truncated": lambda m: _valid(m)[:-1],
    "one byte too long": lambda m: _valid(m) + b"\0",
    "huge header length": lambda m: struct.pack("<Q", 1 << 62) + _valid(m)[8:],
    "header past the end": lambda m: struct.pack("<Q", MAX_HEADER_BYTES) + b"{}",
    "header not json": lambda m: _with_header(b"{not json" + b" " * 7),
    "header not utf8": lambda m: _with_header(b"\xff\xfe\xfd\xfc"),
    "header a list": lambda m: _with_header([1, 2]),
    "extra tensor": lambda m: _with_header(
        {"__metadata__": {}, "kv": {}, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    ),
    "metadata not a dict": lambda m: _with_header({"__metadata__": "x", "kv": {}}),
    "offsets shifted": lambda m: _with_header(
        {
            "__metadata__": {**m.to_metadata(), "dtype": "float32"},
            "kv": {"dtype": "F32", "shape": list(BLOCK), "data_offsets": [4, 4 + 4 * 256]},
        },
        b"\0" * (4 + 4 * 256),
    ),
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_garbage_is_a_miss_never_an_error(kind, meta):
    assert decode_kv_block(GARBAGE[kind](meta), meta, BLOCK, torch.float32) is None


def test_a_wrong_destination_is_a_programming_error(meta):
    with pytest.raises(ValueError, match="out is"):
        decode_kv_block(_valid(meta), meta, BLOCK, torch.float32, out=torch.empty(3))


def test_encoder_output_round_trips_and_checks_its_shape():
    meta = EncoderOutputMeta(fingerprint("gemma3-tiny", "rev0"))
    emb = torch.randn(4, 256).to(torch.bfloat16)
    data = encode_encoder_output(emb, meta)
    assert torch.equal(decode_encoder_output(data, meta, (4, 256), torch.bfloat16), emb)
    assert decode_encoder_output(data, meta, (8, 256), torch.bfloat16) is None
    assert decode_encoder_output(data, EncoderOutputMeta("x"), (4, 256), torch.bfloat16) is None


def test_keys_follow_the_design_scheme():
    assert kv_key("pool-a", "fp1", bytes([0xAB, 0x01])) == "epd:kv:pool-a:fp1:ab01"
    assert kv_key("pool-a", "fp1", 255) == "epd:kv:pool-a:fp1:ff"
    assert kv_key("pool-a", "fp1", "00ff", group=1) == "epd:kv:pool-a:fp1:00ff@g1"
    assert ec_key("pool-a", "fp1", "b3:deadbeef") == "epd:ec:pool-a:fp1:b3:deadbeef"
    assert fingerprint("m", 1) == fingerprint("m", "1") != fingerprint("m", 2)


@pytest.mark.parametrize(
    "call",
    [
        lambda: kv_key("a:b", "fp", 1),
        lambda: kv_key("pool", "has space", 1),
        lambda: kv_key("pool", "fp", -1),
        lambda: kv_key("pool", "fp", "XYZ"),
        lambda: ec_key("pool", "fp", "has space"),
    ],
)
def test_bad_key_parts_are_rejected_with_the_field_named(call):
    with pytest.raises(ValueError, match="pool|fingerprint|block_hash|mm_id"):
        call()


def test_a_non_contiguous_destination_is_filled_through_torch(meta, make_cache):
    block = make_cache()[1]
    dest = torch.zeros(*BLOCK[:-1], 16)[..., ::2]
    assert not dest.is_contiguous()
    out = decode_kv_block(encode_kv_block(block, meta), meta, BLOCK, torch.float32, out=dest)
    assert out is dest and torch.equal(dest, block)
