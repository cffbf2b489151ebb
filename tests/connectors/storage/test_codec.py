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
from epdserve.connectors.storage.codec import MAX_HEADER_BYTES, payload_checksum

BLOCK = (2, 2, 4, 2, 8)
KEY = "epd:kv:pool:tiny-llama-0123:ab01"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_block_round_trips_bit_exact_into_the_destination_slot(dtype, meta, make_cache):
    cache = make_cache(dtype)
    dest = torch.zeros_like(cache)
    slot = dest[5]
    out, reason = decode_kv_block(
        encode_kv_block(cache[3], meta, KEY), meta, BLOCK, dtype, KEY, slot
    )
    assert reason == "" and out is slot and out.data_ptr() == dest[5].data_ptr()
    assert torch.equal(dest[5].view(torch.uint8), cache[3].view(torch.uint8))
    assert dest[[0, 1, 2, 3, 4, 6, 7]].count_nonzero() == 0


def test_without_out_a_fresh_tensor_is_returned(meta, make_cache):
    block = make_cache()[1]
    out = decode_kv_block(encode_kv_block(block, meta, KEY), meta, BLOCK, torch.float32, KEY)
    assert torch.equal(out.tensor, block)


def test_encoded_bytes_are_standard_safetensors_with_the_metadata(meta, make_cache):
    block = make_cache(torch.bfloat16)[2]
    data = encode_kv_block(block, meta, KEY)
    assert torch.equal(safetensors.torch.load(data)["kv"], block)
    (size,) = struct.unpack_from("<Q", data)
    stored = json.loads(data[8 : 8 + size])["__metadata__"]
    checksum = payload_checksum(block.contiguous().view(-1).view(torch.uint8).numpy())
    assert checksum.startswith("xxh3_128:") and len(checksum) == len("xxh3_128:") + 32
    assert stored == {**meta.to_metadata(), "dtype": "bfloat16", "key": KEY, "checksum": checksum}
    assert stored["version"] == "3"


def test_bytes_written_by_safetensors_itself_decode(meta, make_cache):
    block = make_cache()[4]
    checksum = payload_checksum(block.contiguous().view(-1).view(torch.uint8).numpy())
    metadata = {**meta.to_metadata(), "dtype": "float32", "key": KEY, "checksum": checksum}
    data = safetensors.torch.save({"kv": block}, metadata)
    assert torch.equal(decode_kv_block(data, meta, BLOCK, torch.float32, KEY).tensor, block)


@pytest.mark.parametrize(
    "other",
    [
        KVBlockMeta("other-model", 4, "sha256_cbor", 2),
        KVBlockMeta("tiny-llama-0123", 16, "sha256_cbor", 2),
        KVBlockMeta("tiny-llama-0123", 4, "xxhash_cbor", 2),
        KVBlockMeta("tiny-llama-0123", 4, "sha256_cbor", 4),  # another model's head count
        KVBlockMeta("tiny-llama-0123", 4, "sha256_cbor", 2, layout="kv,layer,token,head,dim"),
    ],
)
def test_a_metadata_mismatch_is_a_miss(other, meta, make_cache):
    data = encode_kv_block(make_cache()[0], other, KEY)
    assert decode_kv_block(data, meta, BLOCK, torch.float32, KEY) == (None, "metadata")


@pytest.mark.parametrize("version", [1, 2, 4])
def test_another_format_version_is_a_miss(version, meta, make_cache):
    other = KVBlockMeta(
        meta.fingerprint, meta.block_size, meta.hash_algo, meta.num_kv_heads, version=version
    )
    data = encode_kv_block(make_cache()[0], other, KEY)
    assert decode_kv_block(data, meta, BLOCK, torch.float32, KEY) == (None, "format")


def test_an_encoder_output_under_a_kv_key_is_a_miss(meta):
    data = encode_encoder_output(torch.ones(BLOCK), EncoderOutputMeta(meta.fingerprint), KEY)
    assert decode_kv_block(data, meta, BLOCK, torch.float32, KEY).reason == "not_safetensors"


@pytest.mark.parametrize(
    "shape,dtype",
    [((2, 2, 4, 2, 4), torch.float32), ((1, 2, 4, 2, 8), torch.float32), (BLOCK, torch.bfloat16)],
)
def test_a_shape_or_dtype_mismatch_is_a_miss(shape, dtype, meta, make_cache):
    data = encode_kv_block(make_cache()[0], meta, KEY)
    assert decode_kv_block(data, meta, shape, dtype, KEY) == (None, "dtype_shape")


def test_a_wrong_destination_is_a_programming_error(meta):
    data = encode_kv_block(torch.ones(BLOCK), meta, KEY)
    with pytest.raises(ValueError, match="out is"):
        decode_kv_block(data, meta, BLOCK, torch.float32, KEY, out=torch.empty(3))


def test_encoder_output_round_trips_and_checks_its_shape_and_key():
    meta = EncoderOutputMeta(fingerprint("gemma3-tiny", "rev0"))
    key = ec_key("pool", meta.fingerprint, "b3:img")
    emb = torch.randn(4, 256).to(torch.bfloat16)
    data = encode_encoder_output(emb, meta, key)
    assert torch.equal(decode_encoder_output(data, meta, (4, 256), torch.bfloat16, key)[0], emb)
    assert decode_encoder_output(data, meta, (8, 256), torch.bfloat16, key).reason == "dtype_shape"
    other = EncoderOutputMeta("x")
    assert decode_encoder_output(data, other, (4, 256), torch.bfloat16, key).reason == "metadata"
    assert decode_encoder_output(data, meta, (4, 256), torch.bfloat16, key + "x").reason == "key"


def test_keys_follow_the_design_scheme():
    assert kv_key("pool-a", "fp1", bytes([0xAB, 0x01])) == "epd:kv:pool-a:fp1:ab01"
    assert kv_key("pool-a", "fp1", 255) == "epd:kv:pool-a:fp1:ff"
    assert kv_key("pool-a", "fp1", "00ff", group=1) == "epd:kv:pool-a:fp1:00ff@g1"
    assert kv_key("pool-a", "fp1", "00ff", heads=(4, 4)) == "epd:kv:pool-a:fp1:00ff@h4+4"
    assert kv_key("pool-a", "fp1", "ff", group=1, heads=(0, 1)) == "epd:kv:pool-a:fp1:ff@g1@h0+1"
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
    data = encode_kv_block(block, meta, KEY)
    out = decode_kv_block(data, meta, BLOCK, torch.float32, KEY, out=dest).tensor
    assert out is dest and torch.equal(dest, block)


def test_an_oversized_header_is_refused_when_encoding(meta):
    with pytest.raises(ValueError, match="header"):
        encode_kv_block(torch.ones(BLOCK), meta, "k" * MAX_HEADER_BYTES)
