"""Engine-side KV-event publishers: ZMQ PUB + replay ROUTER, or a no-op.

The engine core calls ``publish(events)`` once per step with the block pool's drained
event queue; encoding and socket I/O happen on a background thread, so a slow or absent
subscriber never blocks the engine loop (a full queue drops the batch and counts it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from epdserve.connectors.kv_events.config import KVEventsConfig, binds
from epdserve.connectors.kv_events.schema import EventBatch, EventEncoder, KVEvent, to_wire_event

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


@dataclass
class PublisherStats:
    """Counters a caller may export as metrics."""

    batches_published: int = 0
    batches_dropped: int = 0
    replay_requests: int = 0
    replay_requests_invalid: int = 0
    send_errors: int = 0
    batches_invalid: int = 0  # events that are not KV cache events


class EventPublisher:
    """What the engine core talks to; ``publish`` must return quickly."""

    stats: PublisherStats

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (an empty list publishes nothing)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush what is queued (briefly) and release sockets and threads."""
        raise NotImplementedError


class NullEventPublisher(EventPublisher):
    """Drops everything: events disabled."""

    def __init__(self) -> None:
        self.stats = PublisherStats()

    def publish(self, events: list[KVEvent]) -> None:
        return None

    def close(self) -> None:
        return None


class ZmqEventPublisher(EventPublisher):
    """vLLM-compatible publisher: ``[topic, seq, payload]`` on PUB, replay on ROUTER.

    ``publish`` takes wire structs or the engine's own event objects with vLLM's field
    names (``bytes`` hashes are cut to their low 64 bits); they are converted and encoded
    later, on the publisher thread, so they must not be mutated afterwards.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        self.stats = PublisherStats()
        self._endpoint, self._replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._hwm, self._rank = hwm, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = EventEncoder()
        self._context = context or zmq.Context.instance()
        self._ready, self._error = threading.Event(), None
        self._closed = False
        self._stop_now = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            self._thread.join(5)
            raise self._error

    @classmethod
    def from_config(cls, config: KVEventsConfig, data_parallel_rank: int = 0) -> ZmqEventPublisher:
        """Build from the parsed ``--kv-events-config``."""
        return cls(
            config.endpoint,
            config.replay_endpoint,
            config.topic,
            config.buffer_steps,
            config.hwm,
            config.max_queue_size,
            data_parallel_rank,
        )

    def publish(self, events: list[KVEvent]) -> None:
        if not events or self._closed:
            return
        batch = EventBatch(ts=time.time(), events=list(events), data_parallel_rank=self._rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.stats.batches_dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            self.stats.batches_dropped += self._queue.qsize()
            self._stop_now = True
        self._thread.join(timeout + 1)

    # --- publisher thread ---------------------------------------------------------------

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 1000)
        _attach(pub, self._endpoint)
        replay = None
        if self._replay_endpoint:
            replay = self._context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            _attach(replay, self._replay_endpoint)
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open()
        except zmq.ZMQError as exc:
            self._error = ValueError(f"kv-events-config: cannot open endpoint: {exc}")
            self._ready.set()
            return
        self._ready.set()
        seq = 0
        try:
            while not self._stop_now:
                if replay is not None:
                    self._serve_replays(replay)
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                payload = self._encode(item)
                if payload is not None:
                    self._send(pub, seq, payload)
                    seq += 1
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _encode(self, batch: EventBatch) -> bytes | None:
        try:
            batch.events = [to_wire_event(e) for e in batch.events]
            return self._encoder.encode(batch)
        except (TypeError, AttributeError, ValueError, OverflowError):
            self.stats.batches_invalid += 1
            log.exception("KV event batch not publishable; dropped")
            return None

    def _send(self, pub: zmq.Socket, seq: int, payload: bytes) -> None:
        seq_bytes = seq.to_bytes(8, "big")
        self._buffer.append((seq, payload))
        try:
            pub.send_multipart((self._topic, seq_bytes, payload), copy=False)
            self.stats.batches_published += 1
        except zmq.ZMQError:
            self.stats.send_errors += 1
            log.exception("KV event publish failed (seq %d)", seq)

    def _serve_replays(self, replay: zmq.Socket) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            self.stats.replay_requests += 1
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.stats.replay_requests_invalid += 1
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    replay.send_multipart(
                        (identity, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            replay.send_multipart((identity, b"", b"", END_SEQ, b""))


def _attach(socket: zmq.Socket, endpoint: str) -> None:
    if binds(endpoint):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


def create_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> EventPublisher:
    """The publisher the config asks for (a no-op one when events are off)."""
    if not config.active:
        return NullEventPublisher()
    return ZmqEventPublisher.from_config(config, data_parallel_rank)
