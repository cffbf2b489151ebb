"""PodSubscriber: replay on start, gap detection -> replay, restarts, garbage.

``WirePublisher`` is a scripted stand-in for a pod's publisher (raw PUB + ROUTER
sockets speaking DESIGN.md §3), so a test can skip or repeat sequence numbers.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from epdserve.connectors.kv_events import (
    BlockStored,
    EventBatch,
    EventEncoder,
    ZmqEventPublisher,
)
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys
from epdserve.router.metrics import RouterMetrics
from epdserve.router.subscriber import PodSubscriber

BS = 4
TOKENS = list(range(1, 41))  # 10 blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_batch(i: int) -> bytes:
    """Batch i stores block i of TOKENS, chained to block i-1."""
    event = BlockStored(
        [1000 + i],
        None if i == 0 else 999 + i,
        TOKENS[i * BS : (i + 1) * BS],
        BS,
        None,
        "GPU",
        None,
        [None],
        0,
    )
    return EventEncoder().encode(EventBatch(0.0, [event], 0))


class WirePublisher:
    """PUB + replay ROUTER driven by the test; replay serves ``self.buffer``."""

    def __init__(self, ctx: zmq.Context):
        self.pub_port, self.replay_port = free_port(), free_port()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: dict[int, bytes] = {}
        self.replay_starts: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if self.router.poll(20):
                ident, _, start = self.router.recv_multipart()
                start = int.from_bytes(start, "big")
                self.replay_starts.append(start)
                for seq in sorted(s for s in self.buffer if s >= start):
                    self.router.send_multipart(
                        [ident, b"", b"t", seq.to_bytes(8, "big"), self.buffer[seq]]
                    )
                self.router.send_multipart(
                    [ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
                )

    def send(self, seq: int, payload: bytes, live: bool = True):
        self.buffer[seq] = payload
        if live:
            self.pub.send_multipart([b"t", seq.to_bytes(8, "big"), payload])

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def wire(ctx):
    w = WirePublisher(ctx)
    yield w
    w.close()


@pytest.fixture
def running(ctx):
    started = []

    def start(events, replay, index, metrics):
        sub = PodSubscriber("p", events, replay, index, metrics, ctx, replay_timeout=1.0)
        sub.start()
        started.append(sub)
        return sub

    yield start
    for sub in started:
        sub.stop()


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within timeout")
        time.sleep(0.01)


def matched(index: PrefixIndex) -> int:
    return index.match(request_keys(TOKENS, BS), ["p"])["p"]


def start_connected(running, wire, index, metrics) -> PodSubscriber:
    """Start a subscriber on a buffer holding seq 0, and wait until live messages flow."""
    sub = running(
        f"tcp://127.0.0.1:{wire.pub_port}", f"tcp://127.0.0.1:{wire.replay_port}", index, metrics
    )
    wait_for(lambda: sub.last_seq is not None)
    for _ in range(500):  # duplicates of seq 0 are ignored, but prove the SUB is connected
        wire.send(0, wire.buffer[0])
        time.sleep(0.01)
        if sub.duplicates:
            return sub
    raise AssertionError("SUB never connected")


def test_replay_on_start_loads_what_the_pod_already_holds(wire, running):
    for i in range(3):
        wire.send(i, block_batch(i), live=False)
    index, metrics = PrefixIndex(), RouterMetrics()
    sub = running(
        f"tcp://127.0.0.1:{wire.pub_port}", f"tcp://127.0.0.1:{wire.replay_port}", index, metrics
    )
    wait_for(lambda: matched(index) == 3)
    assert wire.replay_starts[0] == 0 and sub.last_seq == 2 and sub.missed == 0


def test_a_seq_gap_triggers_a_replay_from_the_last_applied_seq(wire, running):
    wire.send(0, block_batch(0), live=False)
    index, metrics = PrefixIndex(), RouterMetrics()
    sub = start_connected(running, wire, index, metrics)
    wire.send(1, block_batch(1))
    wait_for(lambda: sub.last_seq == 1)
    wire.send(2, block_batch(2), live=False)  # lost on the wire
    wire.send(3, block_batch(3))
    wait_for(lambda: matched(index) == 4)
    # from seq 1, applied already: the pod still holding it unchanged proves no restart
    assert 1 in wire.replay_starts and sub.missed == 0 and not sub.resyncs


def test_what_replay_cannot_return_is_counted_as_missed_and_drops_the_pods_entries(wire, running):
    index, metrics = PrefixIndex(), RouterMetrics()
    wire.send(0, block_batch(0), live=False)
    sub = start_connected(running, wire, index, metrics)
    wire.send(1, block_batch(1))
    wait_for(lambda: sub.last_seq == 1)
    wire.send(4, block_batch(4))  # 2 and 3 never existed anywhere
    wait_for(lambda: sub.last_seq == 4)
    assert sub.missed == 2
    assert (
        metrics.registry.get_sample_value(
            "epdserve_router:kv_event_batches_missed_total", {"pod": "p"}
        )
        == 2
    )
    # a lost batch may have removed blocks: the pod's entries go, batch 4 on rebuilds them
    assert matched(index) == 0 and index.pod_block_count("p") == 0
    resyncs = {"pod": "p", "reason": "missed"}
    assert metrics.registry.get_sample_value("epdserve_router:index_resyncs_total", resyncs) == 1


def test_garbage_messages_are_counted_and_skipped(wire, running):
    index, metrics = PrefixIndex(), RouterMetrics()
    wire.send(0, block_batch(0), live=False)
    sub = start_connected(running, wire, index, metrics)
    wire.send(1, b"\xc1garbage")
    wire.pub.send_multipart([b"t", b"short"])
    wait_for(lambda: sub.last_seq == 1)
    wire.send(2, block_batch(1))
    wait_for(lambda: sub.last_seq == 2)
    invalid = metrics.registry.get_sample_value(
        "epdserve_router:kv_event_batches_invalid_total", {"pod": "p"}
    )
    assert invalid >= 2 and matched(index) == 2


def test_a_publisher_restart_drops_the_pod_and_resyncs(wire, running):
    index, metrics = PrefixIndex(), RouterMetrics()
    for i in range(3):
        wire.send(i, block_batch(i), live=False)
    sub = start_connected(running, wire, index, metrics)
    wire.send(3, block_batch(3))
    wait_for(lambda: sub.last_seq == 3)
    wire.buffer.clear()  # the pod restarted: empty cache, seq from 0, other payloads
    wire.send(0, block_batch(5))
    wait_for(lambda: sub.last_seq == 0)
    assert matched(index) == 0 and index.pod_block_count("p") == 0


def test_follows_our_own_publisher_end_to_end(ctx, running):
    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", "t", context=ctx)
    try:
        publisher.publish(
            [BlockStored([7, 8], None, TOKENS[:8], BS, None, "GPU", None, [None, None], 0)]
        )
        index, metrics = PrefixIndex(), RouterMetrics()
        sub = running(
            f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", index, metrics
        )
        wait_for(lambda: matched(index) == 2)
        publisher.publish([BlockStored([9], 8, TOKENS[8:12], BS, None, "GPU", None, [None], 0)])
        wait_for(lambda: matched(index) == 3)
        assert sub.missed == 0
    finally:
        publisher.close()
