"""ZmqEventPublisher seen through an independent minimal subscriber.

The subscriber below is written from DESIGN.md §3 only (pyzmq + untyped msgspec), so it
does not share code or assumptions with our decoder.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from epdserve.connectors.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    create_publisher,
)

TOPIC = "kv@127.0.0.1:8000@tiny"


def free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def publisher():
    pub_port, replay_port = free_tcp_port(), free_tcp_port()
    p = ZmqEventPublisher(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", TOPIC, buffer_steps=4)
    p.ports = (pub_port, replay_port)
    yield p
    p.close()


def recv_live(sub: zmq.Socket) -> tuple[str, int, list]:
    assert sub.poll(5000), "no PUB message within 5 s"
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic.decode(), int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)


def replay(ctx: zmq.Context, port: int, start: int) -> list[tuple[bytes, int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "replay did not answer within 5 s"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seq_no = int.from_bytes(seq, "big", signed=True)
            if seq_no == -1:
                assert topic == b"" and payload == b""
                return replies
            replies.append((topic, seq_no, payload))
    finally:
        dealer.close()


def subscribe(ctx: zmq.Context, port: int, publisher: ZmqEventPublisher) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    # slow joiner: publish probes until one arrives, then drain
    for _ in range(100):
        publisher.publish([AllBlocksCleared()])
        if sub.poll(50):
            break
    while sub.poll(200):
        sub.recv_multipart()
    return sub


def test_block_stored_arrives_as_three_frames_with_map_events(ctx, publisher):
    sub = subscribe(ctx, publisher.ports[0], publisher)
    stored = BlockStored([11, 12], 10, [1, 2, 3, 4], 2, None, "GPU", None, [None, None], 0)
    publisher.publish([stored, BlockRemoved([(1 << 64) - 1], "GPU", 0)])
    topic, seq, (ts, events, rank) = recv_live(sub)
    assert topic == TOPIC and rank == 0 and ts == pytest.approx(time.time(), abs=60)
    first, second = events
    assert first["type"] == "BlockStored" and first["block_hashes"] == [11, 12]
    assert first["parent_block_hash"] == 10 and first["token_ids"] == [1, 2, 3, 4]
    assert first["extra_keys"] == [None, None] and first["block_size"] == 2
    assert second == {
        "type": "BlockRemoved",
        "block_hashes": [(1 << 64) - 1],
        "medium": "GPU",
        "group_idx": 0,
    }


def test_sequence_numbers_increase_by_one_and_empty_steps_publish_nothing(ctx, publisher):
    sub = subscribe(ctx, publisher.ports[0], publisher)
    publisher.publish([BlockRemoved([1], "GPU")])
    publisher.publish([])
    publisher.publish([BlockRemoved([2], "GPU")])
    (_, s1, b1), (_, s2, b2) = recv_live(sub), recv_live(sub)
    assert s2 == s1 + 1
    assert [b1[1][0]["block_hashes"], b2[1][0]["block_hashes"]] == [[1], [2]]
    assert not sub.poll(200)


def test_replay_returns_buffered_batches_in_order_then_the_end_marker(ctx, publisher):
    for h in range(6):  # buffer keeps the last 4 batches: seq 2..5
        publisher.publish([BlockRemoved([h], "GPU")])
    deadline = time.monotonic() + 5
    while publisher.stats.batches_published < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    got = replay(ctx, publisher.ports[1], 0)
    assert [s for _, s, _ in got] == [2, 3, 4, 5]
    assert all(topic == TOPIC.encode() for topic, _, _ in got)
    assert [msgspec.msgpack.decode(p)[1][0]["block_hashes"] for _, _, p in got] == [
        [2],
        [3],
        [4],
        [5],
    ]
    assert [s for _, s, _ in replay(ctx, publisher.ports[1], 4)] == [4, 5]
    assert replay(ctx, publisher.ports[1], 1000) == []


def test_malformed_replay_requests_are_counted_and_ignored(ctx, publisher):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{publisher.ports[1]}")
    dealer.send_multipart([b"", b"xx"])
    deadline = time.monotonic() + 5
    while publisher.stats.replay_requests_invalid < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    dealer.close()
    assert publisher.stats.replay_requests_invalid == 1
    assert replay(ctx, publisher.ports[1], 0) == []


def test_a_publisher_with_no_subscriber_never_blocks_and_drops_when_full():
    p = ZmqEventPublisher(f"tcp://*:{free_tcp_port()}", max_queue_size=1, hwm=1)
    try:
        for _ in range(2000):
            p.publish([BlockRemoved([1], "GPU")])
    finally:
        p.close()
    assert p.stats.batches_published + p.stats.batches_dropped == 2000


def test_disabled_config_gives_the_null_publisher():
    assert isinstance(create_publisher(KVEventsConfig()), NullEventPublisher)


def test_a_busy_endpoint_is_a_clear_error():
    port = free_tcp_port()
    first = ZmqEventPublisher(f"tcp://*:{port}")
    try:
        with pytest.raises(ValueError, match="endpoint"):
            ZmqEventPublisher(f"tcp://*:{port}")
    finally:
        first.close()


def test_engine_side_events_with_byte_hashes_are_published_as_vllm_does(ctx, publisher):
    from dataclasses import dataclass, field

    @dataclass
    class BlockStored:  # the engine's own shape (engine/core/block_pool.py)
        block_hashes: list
        parent_block_hash: bytes | None
        token_ids: list
        block_size: int
        extra_keys: list = field(default_factory=list)
        group_idx: int = 0

    sub = subscribe(ctx, publisher.ports[0], publisher)
    h1, h0 = b"\x01" * 24 + (5).to_bytes(8, "big"), b"\x02" * 32
    publisher.publish([BlockStored([h1], h0, [1, 2], 2, [None])])
    _, _, (_, (event,), _) = recv_live(sub)
    assert event == {
        "type": "BlockStored",
        "block_hashes": [5],
        "parent_block_hash": int.from_bytes(h0[-8:], "big"),
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def test_objects_that_are_not_events_are_counted_not_published(publisher):
    publisher.publish([object()])
    deadline = time.monotonic() + 5
    while publisher.stats.batches_invalid < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.stats.batches_invalid == 1 and publisher.stats.batches_published == 0


def test_an_unencodable_batch_is_dropped_and_publishing_goes_on(ctx, publisher):
    sub = subscribe(ctx, publisher.ports[0], publisher)
    bad = BlockStored([1], None, [1, 2], 2, None, "GPU", None, [object()], 0)
    publisher.publish([bad])
    publisher.publish([BlockRemoved([9], "GPU", 0)])
    _, _, (_, events, _) = recv_live(sub)
    assert events[0]["block_hashes"] == [9] and publisher.stats.batches_invalid == 1
