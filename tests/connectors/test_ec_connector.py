"""Encoder-cache connectors: one conformance suite over both backends (a real redis-server;
a shared directory), driven through ``--ec-transfer-config`` exactly as pods build them."""

from __future__ import annotations

import json

import pytest
import torch

from epdserve.connectors.ec_connector import ECTransferConfig, create_ec_connector

IMAGE = "3f" * 32  # an image identifier
CROP = IMAGE + ".1"  # a pan-and-scan crop of it


@pytest.fixture(params=["RedisECConnector", "SharedStorageECConnector"])
def backend(request, tmp_path):
    """``make(role, fingerprint="gemma3-tiny", **extra) -> connector`` for one backend."""
    name = request.param
    if name == "RedisECConnector":
        where = {"url": request.getfixturevalue("redis_url")}
    else:
        where = {"path": str(tmp_path / "ec")}
    made = []

    def make(role, fingerprint="gemma3-tiny", **extra):
        config = {
            "ec_connector": name,
            "ec_role": role,
            "ec_connector_extra_config": {**where, **extra},
        }
        connector = create_ec_connector(ECTransferConfig.parse(json.dumps(config)), fingerprint)
        made.append(connector)
        return connector

    make.name, make.where = name, where
    yield make
    for connector in made:
        connector.close()


def test_a_producer_saves_and_a_consumer_finds_and_loads_bit_exact(backend):
    producer, consumer = backend("ec_producer"), backend("ec_consumer")
    image, crop = torch.randn(4, 64).to(torch.bfloat16), torch.randn(4, 64).to(torch.bfloat16)
    assert consumer.start_load_caches([IMAGE], [(4, 64)], torch.bfloat16) == [None]
    producer.save_caches([(IMAGE, image), (CROP, crop)])
    assert producer.saved == 2
    assert consumer.stored([IMAGE, CROP, "other"]) == [True, True, False]
    got = consumer.start_load_caches([IMAGE, CROP], [(4, 64), (4, 64)], torch.bfloat16)
    assert torch.equal(got[0], image) and torch.equal(got[1], crop)
    assert (consumer.loaded, consumer.load_failures) == (2, 1)


def test_only_producers_save(backend):
    producer, consumer = backend("ec_producer"), backend("ec_consumer")
    consumer.save_caches([(IMAGE, torch.ones(4, 64))])
    assert consumer.saved == 0 and producer.stored([IMAGE]) == [False]
    producer.save_caches([(IMAGE, torch.ones(4, 64))])
    assert producer.stored([IMAGE]) == [True]  # the encoder pod does not encode it again
    both = backend("ec_both")
    assert torch.equal(
        both.start_load_caches([IMAGE], [(4, 64)], torch.float32)[0], torch.ones(4, 64)
    )


def test_outputs_of_another_model_pool_shape_or_dtype_are_misses(backend):
    backend("ec_producer").save_caches([(IMAGE, torch.ones(4, 64))])
    assert backend("ec_consumer", fingerprint="other-model").stored([IMAGE]) == [False]
    assert backend("ec_consumer", pool="other-pool").stored([IMAGE]) == [False]
    consumer = backend("ec_consumer")
    assert torch.equal(
        consumer.start_load_caches([IMAGE], [(4, 64)], torch.float32)[0], torch.ones(4, 64)
    )
    # a key names one model's output of one image, so another shape under it is damage
    assert consumer.start_load_caches([IMAGE], [(5, 64)], torch.float32) == [None]
    assert consumer.load_failures == 1 and consumer.rejections() == {"dtype_shape": 1}
    assert consumer.stored([IMAGE]) == [False]  # deleted


def test_garbage_in_the_store_is_a_miss_not_an_error(backend):
    consumer = backend("ec_consumer")
    consumer.store.put_many([(consumer.io.key(IMAGE), b"\x00garbage")])
    assert consumer.stored([IMAGE]) == [True]  # present, but...
    assert consumer.start_load_caches([IMAGE], [(4, 64)], torch.float32) == [None]
    assert consumer.load_failures == 1 and consumer.rejections() == {"header_too_large": 1}
    assert consumer.stored([IMAGE]) == [False]  # deleted: the next pod encodes it


def flip_last_bit(connector, key: str) -> None:
    """Damage one bit of a stored value in place, behind the store's back."""
    if "url" in connector.config.ec_connector_extra_config:
        import redis

        client = redis.Redis.from_url(connector.config.ec_connector_extra_config["url"])
        last = client.strlen(key) - 1
        client.setrange(key, last, bytes([client.getrange(key, last, last)[0] ^ 1]))
        client.close()
        return
    with open(connector.store.path_of(key), "r+b") as f:
        f.seek(-1, 2)
        byte = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([byte ^ 1]))


def deep_header(depth: int = 8_000) -> bytes:
    raw = b"[" * depth + b"]" * depth
    return len(raw).to_bytes(8, "little") + raw + bytes(1024)


@pytest.mark.parametrize("damage", ["bit flip", "deep header", "swapped keys"])
def test_a_damaged_output_is_a_counted_miss_deleted_and_never_an_error(backend, damage):
    producer, consumer = backend("ec_producer"), backend("ec_consumer")
    image, crop = torch.randn(4, 64), torch.randn(4, 64)
    producer.save_caches([(IMAGE, image), (CROP, crop)])
    keys = [consumer.io.key(IMAGE), consumer.io.key(CROP)]
    if damage == "bit flip":
        flip_last_bit(consumer, keys[0])
        expected = {"checksum": 1}
    elif damage == "deep header":
        consumer.store.put_many([(keys[0], deep_header())])
        expected = {"too_deep": 1}
    else:  # each value stored under the other's key: same shape, but not that image's output
        values = consumer.store.get_many(keys)
        consumer.store.put_many([(keys[0], values[1]), (keys[1], values[0])])
        expected = {"key": 2}
    for _ in range(2):  # a retry is a plain miss (the bad value is gone), still no error
        got = consumer.start_load_caches([IMAGE, CROP], [(4, 64)] * 2, torch.float32)
        assert got[0] is None
        assert (got[1] is None) == (damage == "swapped keys")
        assert consumer.rejections() == expected
    assert consumer.stored([IMAGE]) == [False]


def test_an_unreachable_store_is_a_miss_and_saves_fail_softly(backend, read_only):
    if backend.name == "RedisECConnector":
        extra = {"url": "redis://127.0.0.1:1/0"}  # nothing listens there
        producer, consumer = backend("ec_producer", **extra), backend("ec_consumer", **extra)
        undo = None
    else:
        producer, consumer = backend("ec_producer"), backend("ec_consumer")
        undo = read_only(backend.where["path"])
    try:
        producer.save_caches([(IMAGE, torch.ones(4, 64))])
        assert producer.saved == 0
        assert consumer.stored([IMAGE]) == [False]
        assert consumer.start_load_caches([IMAGE], [(4, 64)], torch.float32) == [None]
    finally:
        if undo is not None:
            undo()
