"""Per-pod KV-event subscriber: SUB for live batches, replay on start and after a gap.

Batches are applied to the :class:`PrefixIndex` strictly in seq order. A seq gap asks the
pod's replay socket for what was lost (again and again while answers come: a pod caps each
answer); whatever the replay cannot return is counted as missed. A seq that goes backwards
with a payload other than the one applied for it means the pod's publisher restarted: the
pod's blocks are dropped and resynced from seq 0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from epdserve.connectors.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CurveClientKeys,
    EventDecodeError,
    EventDecoder,
)
from epdserve.connectors.kv_events.sockets import DEFAULT_MAX_EVENT_BYTES
from epdserve.router.index import IngestResult, PrefixIndex
from epdserve.router.metrics import RouterMetrics
from epdserve.router.seedcheck import RootHashCheck

log = logging.getLogger(__name__)
RECENT_SEQS = 4096  # payload fingerprints kept to tell replay duplicates from a restart
MAX_REPLAY_ROUNDS = 1000  # capped answers asked for in a row before giving up on the rest
RECONNECT_INTERVAL = 1.0  # s between our own reconnects after a dropped connection
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass(frozen=True)
class EventSocketOptions:
    """How the router's SUB and replay DEALER sockets talk to the pods."""

    curve: CurveClientKeys | None = None  # Curve client keys (the pods are Curve servers)
    max_message_bytes: int = DEFAULT_MAX_EVENT_BYTES  # larger frames: the pod is dropped

    def apply(self, socket: zmq.Socket) -> None:
        """Set on ``socket`` before it connects."""
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if self.curve is not None:
            self.curve.apply(socket)


class PodSubscriber:
    """Keeps one pod's part of the index in sync with its event stream (own thread)."""

    def __init__(
        self,
        pod: str,
        events_endpoint: str,
        replay_endpoint: str | None,
        index: PrefixIndex,
        metrics: RouterMetrics,
        context: zmq.Context | None = None,
        replay_timeout: float = 2.0,
        root_check: RootHashCheck | None = None,
        options: EventSocketOptions | None = None,
    ) -> None:
        self.pod = pod
        self._options = options or EventSocketOptions()
        self._events, self._replay_endpoint = events_endpoint, replay_endpoint
        self._index, self._metrics = index, metrics
        self._root_check = root_check
        self._context = context or zmq.Context.instance()
        self._replay_timeout_ms = int(replay_timeout * 1000)
        self._decoder = EventDecoder()
        self._stop = threading.Event()
        self.last_seq: int | None = None
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> hash(payload)
        self.duplicates = 0
        self.batches_applied = 0
        self.missed = 0
        self.handshake_failures = 0  # Curve refused (wrong keys) or one side without Curve
        self.reconnects = 0
        self._reconnect_at: float | None = None
        self._last_reconnect = 0.0
        self._thread = threading.Thread(target=self._run, name=f"kv-sub-{pod}", daemon=True)

    def start(self) -> None:
        """Connect and start following the pod's events."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 100_000)
        self._options.apply(sub)
        monitor = sub.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sub.connect(self._events)
            self._catch_up(0)
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    self._on_monitor(monitor)
                if sub in ready:
                    self._on_live_guarded(sub.recv_multipart())
                if self._reconnect_at is not None and time.monotonic() >= self._reconnect_at:
                    self._reconnect(sub)
        except zmq.ZMQError:
            self._metrics.events_invalid.labels(self.pod).inc()
            log.exception("KV event subscriber for %s stopped", self.pod)
        finally:
            sub.disable_monitor()
            monitor.close()
            sub.close()

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            # libzmq gives up on a connection it dropped for a protocol error (a frame over
            # --kv-events-max-message-bytes, say): connect again ourselves, at most 1/s
            self._reconnect_at = max(time.monotonic(), self._last_reconnect + RECONNECT_INTERVAL)
            return
        self.handshake_failures += 1
        if self.handshake_failures == 1:  # the pod retries every reconnect: say it once
            log.warning(
                "pod %s: KV-event handshake failed (event %s, %s): do the router's and the "
                "pod's --kv-events-curve-dir hold one pool's keys?",
                self.pod,
                event["event"],
                event["endpoint"],
            )

    def _reconnect(self, sub: zmq.Socket) -> None:
        self._reconnect_at, self._last_reconnect = None, time.monotonic()
        self.reconnects += 1
        with contextlib.suppress(zmq.ZMQError):  # libzmq may have forgotten the endpoint
            sub.disconnect(self._events)
        sub.connect(self._events)
        log.info("pod %s: KV-event connection dropped; connected again", self.pod)

    def _on_live_guarded(self, frames: list[bytes]) -> None:
        try:
            self._on_live(frames)
        except Exception:  # one bad message must not stop the subscriber
            self._metrics.events_invalid.labels(self.pod).inc()
            log.exception("pod %s: failed to apply a KV event message", self.pod)

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._metrics.events_invalid.labels(self.pod).inc()
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.last_seq
        if last is not None and seq <= last:
            if self._recent.get(seq) == hash(frames[2]):
                self.duplicates += 1  # already applied (from a replay)
                return
            log.warning("pod %s: event seq went back %d -> %d; resyncing", self.pod, last, seq)
            self._index.clear_pod(self.pod)
            self._recent.clear()
            self.last_seq = None
            self._catch_up(0, until=seq)
            if self.last_seq is not None and seq <= self.last_seq:
                return
        elif last is not None and seq > last + 1:
            self._catch_up(last + 1, until=seq)
            if self.last_seq is not None and seq <= self.last_seq:
                return
        self._accept(seq, frames[2])

    def _accept(self, seq: int, payload: bytes) -> None:
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq > expected:  # a publisher starts at 0: anything skipped is lost
            self._count_missed(seq - expected)
        self.last_seq = seq
        self._recent[seq] = hash(payload)
        if len(self._recent) > RECENT_SEQS:
            self._recent.popitem(last=False)
        try:
            batch = self._decoder.decode(payload)
        except EventDecodeError:
            self._metrics.events_invalid.labels(self.pod).inc()
            return
        self._record(self._index.apply(self.pod, batch), batch.events)
        self.batches_applied += 1

    def _count_missed(self, n: int) -> None:
        self.missed += n
        self._metrics.events_missed.labels(self.pod).inc(n)

    def _record(self, result: IngestResult, events: list) -> None:
        m = self._metrics
        counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        for event in events:
            if isinstance(event, BlockStored):
                counts["BlockStored"] += 1
            elif isinstance(event, BlockRemoved):
                counts["BlockRemoved"] += 1
            elif isinstance(event, AllBlocksCleared):
                counts["AllBlocksCleared"] += 1
        for kind, n in counts.items():
            if n:
                m.events_received.labels(self.pod, kind).inc(n)
        if result.orphaned:
            m.blocks_unindexed.labels(self.pod, "unknown_parent").inc(result.orphaned)
        if result.skipped:
            m.blocks_unindexed.labels(self.pod, "extra_keys_or_invalid").inc(result.skipped)
        if result.roots and self._root_check is not None:
            self._root_check.observe(self.pod, result.roots)

    def _catch_up(self, start: int, until: int | None = None) -> None:
        """Replay from ``start`` until an answer brings nothing new or ``until`` is reached
        (a pod caps each answer, so one request may not bring everything)."""
        for _ in range(MAX_REPLAY_ROUNDS):
            before = self.last_seq
            if self._replay(start) != "ok" or self.last_seq == before or self._stop.is_set():
                return
            if until is not None and self.last_seq >= until:
                return
            start = self.last_seq + 1

    def _replay(self, start: int) -> str | None:
        """Ask the replay socket for the batches from ``start`` on and apply them."""
        if not self._replay_endpoint:
            return None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        self._options.apply(dealer)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
            outcome = self._read_replay(dealer)
        except zmq.ZMQError:
            outcome = "error"
        finally:
            dealer.close()
        self._metrics.replays.labels(self.pod, outcome).inc()
        return outcome

    def _read_replay(self, dealer: zmq.Socket) -> str:
        while not self._stop.is_set():
            if not dealer.poll(self._replay_timeout_ms):
                return "timeout"
            frames = dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self._metrics.events_invalid.labels(self.pod).inc()
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return "ok"
            if self.last_seq is None or seq > self.last_seq:
                self._accept(seq, frames[3])
        return "stopped"
