"""The router's side of the KV-event sockets: capped replays are asked again, Curve keys,
and frames over the size bound (real publisher, real sockets)."""

from __future__ import annotations

import time

import pytest
import zmq

from epdserve.connectors.kv_events import (
    BlockRemoved,
    BlockStored,
    CurveClientKeys,
    EventBatch,
    EventEncoder,
    ZmqEventPublisher,
    create_publisher,
)
from epdserve.connectors.kv_events.config import KVEventsConfig
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys
from epdserve.router.metrics import RouterMetrics
from epdserve.router.subscriber import EventSocketOptions, PodSubscriber

BS = 4
TOKENS = list(range(1, 41))  # 10 blocks


def block_event(i: int) -> BlockStored:
    """Block i of TOKENS, chained to block i-1."""
    parent = None if i == 0 else 999 + i
    return BlockStored([1000 + i], parent, TOKENS[i * BS : (i + 1) * BS], BS, None, "GPU", None)


def matched(index: PrefixIndex) -> int:
    return index.match(request_keys(TOKENS, BS), ["p"])["p"]


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.01)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def subscribe(ctx):
    started = []

    def start(events: str, replay: str | None, options=None) -> tuple[PodSubscriber, PrefixIndex]:
        index = PrefixIndex()
        sub = PodSubscriber(
            "p", events, replay, index, RouterMetrics(), ctx, replay_timeout=1.0, options=options
        )
        sub.start()
        started.append(sub)
        return sub, index

    yield start
    for sub in started:
        sub.stop()


def test_capped_answers_are_asked_again_until_the_index_caught_up(tmp_path, subscribe):
    publisher = ZmqEventPublisher(
        f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay", "t", replay_max_batches=3
    )
    try:
        for i in range(10):
            publisher.publish([block_event(i)])
        wait_for(lambda: publisher.stats.batches_published == 10)
        sub, index = subscribe(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay")
        wait_for(lambda: matched(index) == 10, what="all 10 blocks indexed")
        assert sub.missed == 0 and publisher.stats.replay_answers_capped == 3
    finally:
        publisher.close()


def curve_publisher(curve_dirs, tmp_path) -> ZmqEventPublisher:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/cev",
        replay_endpoint=f"ipc://{tmp_path}/creplay",
    )
    return create_publisher(cfg, curve_dir=curve_dirs.engine)


@pytest.fixture
def curve_dirs(tmp_path):
    from types import SimpleNamespace

    server, client, other = zmq.curve_keypair(), zmq.curve_keypair(), zmq.curve_keypair()
    files = {
        "engine": {"server": server, "client.public": client[0]},
        "router": {"client": client, "server.public": server[0]},
        "stranger": {"client": other, "server.public": server[0]},
    }
    dirs = {}
    for name, items in files.items():
        d = tmp_path / name
        d.mkdir()
        for key, value in items.items():
            if isinstance(value, tuple):  # a pair: KEY.public and KEY.secret
                (d / f"{key}.public").write_bytes(value[0])
                (d / f"{key}.secret").write_bytes(value[1])
            else:
                (d / key).write_bytes(value)
        dirs[name] = d
    return SimpleNamespace(**dirs)


def test_with_the_pools_keys_replay_and_live_events_reach_the_index(
    curve_dirs, tmp_path, subscribe
):
    publisher = curve_publisher(curve_dirs, tmp_path)
    try:
        for i in range(3):
            publisher.publish([block_event(i)])
        wait_for(lambda: publisher.stats.batches_published == 3)
        options = EventSocketOptions(CurveClientKeys.load(curve_dirs.router))
        sub, index = subscribe(f"ipc://{tmp_path}/cev", f"ipc://{tmp_path}/creplay", options)
        wait_for(lambda: matched(index) == 3, what="replayed over Curve")
        probes = 0
        while sub.last_seq == 2 and probes < 500:  # until the SUB's handshake is done
            publisher.publish([BlockRemoved([77], "GPU")])
            probes += 1
            time.sleep(0.02)
        for i in range(3, 10):  # live now
            publisher.publish([block_event(i)])
        wait_for(lambda: matched(index) == 10, what="live over Curve")
        assert sub.handshake_failures == 0 and publisher.stats.auth_denied == 0
    finally:
        publisher.close()


def test_with_a_strangers_key_nothing_is_indexed_and_the_failure_is_seen(
    curve_dirs, tmp_path, subscribe
):
    publisher = curve_publisher(curve_dirs, tmp_path)
    try:
        publisher.publish([block_event(0)])
        options = EventSocketOptions(CurveClientKeys.load(curve_dirs.stranger))
        sub, index = subscribe(f"ipc://{tmp_path}/cev", f"ipc://{tmp_path}/creplay", options)
        wait_for(lambda: sub.handshake_failures >= 1, what="handshake failure seen")
        for i in range(1, 10):
            publisher.publish([block_event(i)])
        wait_for(lambda: publisher.stats.batches_published == 10)
        assert matched(index) == 0 and sub.last_seq is None
        assert publisher.stats.auth_denied >= 1 and publisher.stats.replay_batches_sent == 0
    finally:
        publisher.close()


def test_a_frame_over_the_bound_is_dropped_and_later_batches_still_apply(ctx, tmp_path, subscribe):
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/raw")
    encode = EventEncoder().encode

    def send(seq: int, payload: bytes) -> None:
        pub.send_multipart([b"t", seq.to_bytes(8, "big"), payload])

    options = EventSocketOptions(max_message_bytes=4096)
    sub, index = subscribe(f"ipc://{tmp_path}/raw", None, options)
    first = encode(EventBatch(0.0, [block_event(0)], 0))
    deadline = time.monotonic() + 10
    while sub.last_seq is None and time.monotonic() < deadline:  # slow joiner
        send(0, first)
        time.sleep(0.02)
    send(1, b"\x00" * 8192)  # over the bound: the SUB drops the connection, then reconnects
    other = [90, 91, 92, 93]  # later batches: first blocks of another prompt
    seq = 2
    while sub.last_seq in (0, None) and time.monotonic() < deadline:
        event = BlockStored([5000 + seq], None, other, BS, None, "GPU", None)
        send(seq, encode(EventBatch(0.0, [event], 0)))
        seq += 1
        time.sleep(0.02)
    assert sub.last_seq is not None and sub.last_seq >= 2 and sub.missed >= 1
    assert sub.reconnects >= 1  # libzmq alone would not have connected again
    assert index.match(request_keys(other, BS), ["p"]) == {"p": 1}
    pub.close(0)
