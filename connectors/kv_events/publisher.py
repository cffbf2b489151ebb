"""Engine-side KV-event publishers: ZMQ PUB + replay ROUTER, or a no-op.

The engine core calls ``publish(events)`` once per step with the block pool's drained
event queue; encoding and socket I/O happen on a background thread, so a slow or absent
subscriber never blocks the engine loop (a full queue drops the batch and counts it).
Replays are answered by a second thread (:mod:`.replay`), bounded, in slices, so they never
hold up live batches. Wildcard endpoints bind the pod IP when ``EPDSERVE_POD_IP`` is set;
with Curve keys both sockets admit only the listed clients.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from epdserve.connectors.kv_events.config import KVEventsConfig, pod_ip_from_env
from epdserve.connectors.kv_events.curve import CurveServer, CurveServerKeys
from epdserve.connectors.kv_events.digest import StreamDigest, encode_answer
from epdserve.connectors.kv_events.replay import END_SEQ, ReplayBuffer, ReplayServer
from epdserve.connectors.kv_events.schema import EventBatch, EventEncoder, KVEvent, to_wire_event
from epdserve.connectors.kv_events.sockets import MAX_REQUEST_BYTES, attach, pin_io_thread

log = logging.getLogger(__name__)

__all__ = [
    "END_SEQ",
    "EventPublisher",
    "NullEventPublisher",
    "PublisherStats",
    "ZmqEventPublisher",
    "create_publisher",
]
_STOP = object()


@dataclass
class PublisherStats:
    """Counters a caller may export as metrics."""

    batches_published: int = 0
    batches_dropped: int = 0
    replay_requests: int = 0
    replay_requests_invalid: int = 0
    replay_requests_busy: int = 0  # the peer already has a replay in flight
    replay_requests_refused: int = 0  # replay_max_in_flight peers were being served
    replay_answers_capped: int = 0  # answers cut at replay_max_batches
    replay_batches_sent: int = 0
    replay_stalled: int = 0  # answers dropped: the peer read nothing for a while
    digest_requests: int = 0  # routers reconciling their index (see .digest)
    send_errors: int = 0
    batches_invalid: int = 0  # events that are not KV cache events
    auth_denied: int = 0  # Curve handshakes refused (unlisted client key)


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
    later, on the publisher thread, so they must not be mutated afterwards. With
    ``curve_keys`` leave ``context`` unset: the ZAP handler is one per context.
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
        replay_max_batches: int = 1_000,
        replay_max_in_flight: int = 64,
        pod_ip: str | None = None,
        curve_keys: CurveServerKeys | None = None,
    ) -> None:
        self.stats = PublisherStats()
        self._endpoint, self._pod_ip = endpoint, pod_ip
        self._topic = topic.encode()
        self._hwm, self._rank = hwm, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer = ReplayBuffer(buffer_steps)
        self._encoder = EventEncoder()
        # this process's identity (routers tell a restart by it) and the running digest of
        # every batch sent, answered on the replay socket
        self.instance = secrets.randbits(64)
        self._digest, self._next_seq = StreamDigest(), 0
        self._digest_lock = threading.Lock()
        # our own context by default: two I/O threads (live and replay traffic apart) and a
        # ZAP handler that serves only these sockets
        self._owns_context = context is None
        self._context = context or zmq.Context(io_threads=2)
        self._curve: CurveServer | None = None
        self._ready, self._error = threading.Event(), None
        self._closed = False
        self._stop_now = False
        self.address: str | None = None
        self._replay: ReplayServer | None = None
        try:
            if curve_keys is not None:
                self._curve = CurveServer(curve_keys, self._context, self.stats)
            if replay_endpoint:
                self._replay = ReplayServer(
                    replay_endpoint,
                    self._buffer,
                    self._topic,
                    self.stats,
                    self._context,
                    replay_max_batches,
                    replay_max_in_flight,
                    pod_ip,
                    self._curve,
                    self.digest_answer,
                )
            self._thread = threading.Thread(
                target=self._run, name="kv-event-publisher", daemon=True
            )
            self._thread.start()
            self._ready.wait(10)
            if self._error is not None:
                self._thread.join(5)
                raise self._error
        except BaseException:
            self._release()
            raise

    @classmethod
    def from_config(
        cls,
        config: KVEventsConfig,
        data_parallel_rank: int = 0,
        pod_ip: str | None = None,
        curve_keys: CurveServerKeys | None = None,
    ) -> ZmqEventPublisher:
        """Build from the parsed ``--kv-events-config``."""
        return cls(
            config.endpoint,
            config.replay_endpoint,
            config.topic,
            config.buffer_steps,
            config.hwm,
            config.max_queue_size,
            data_parallel_rank,
            replay_max_batches=config.replay_max_batches,
            replay_max_in_flight=config.replay_max_in_flight,
            pod_ip=pod_ip,
            curve_keys=curve_keys,
        )

    def digest_answer(self) -> bytes:
        """The encoded digest of every batch sent so far (any thread)."""
        with self._digest_lock:
            return encode_answer(self._digest.answer(self.instance, self._next_seq))

    @property
    def replay_address(self) -> str | None:
        return self._replay.address if self._replay else None

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
        self._release()

    def _release(self) -> None:
        if self._replay is not None:
            self._replay.close()
        if self._curve is not None:
            self._curve.stop()
        if self._owns_context:
            self._context.term()

    # --- publisher thread ---------------------------------------------------------------

    def _open(self) -> zmq.Socket:
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 1000)
        pub.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # it reads only subscriptions
        pin_io_thread(pub, self._context, 0)
        if self._curve is not None:
            self._curve.apply(pub)
        try:
            self.address = attach(pub, self._endpoint, self._pod_ip, "PUB")
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        return pub

    def _run(self) -> None:
        try:
            pub = self._open()
        except zmq.ZMQError as exc:
            self._error = ValueError(f"kv-events-config: cannot open endpoint: {exc}")
            self._ready.set()
            return
        self._ready.set()
        seq = 0
        try:
            while not self._stop_now:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                payload = self._encode(item)
                if payload is None:
                    continue
                with self._digest_lock:  # an answer covers exactly the batches sent
                    self._send(pub, seq, payload)
                    self._digest.apply(item.events)
                    seq = self._next_seq = seq + 1
        finally:
            pub.close()

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
        self._buffer.append(seq, payload)
        try:
            pub.send_multipart((self._topic, seq_bytes, payload), copy=False)
            self.stats.batches_published += 1
        except zmq.ZMQError:
            self.stats.send_errors += 1
            log.exception("KV event publish failed (seq %d)", seq)


def create_publisher(
    config: KVEventsConfig, data_parallel_rank: int = 0, curve_dir: str | Path | None = None
) -> EventPublisher:
    """The publisher the config asks for (a no-op one when events are off). Wildcard
    endpoints bind ``EPDSERVE_POD_IP`` when it is set; ``curve_dir`` turns Curve on."""
    if not config.active:
        return NullEventPublisher()
    keys = CurveServerKeys.load(curve_dir) if curve_dir else None
    return ZmqEventPublisher.from_config(config, data_parallel_rank, pod_ip_from_env(), keys)
