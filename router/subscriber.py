"""Per-pod KV-event subscriber: SUB for live batches, replay on start and after a gap.

Batches are applied to the :class:`PrefixIndex` strictly in seq order. A seq gap asks the
pod's replay socket for what was lost (again and again while answers come: a pod caps each
answer); whatever the replay cannot return is counted as missed, and the pod's entries are
dropped (a lost removal would leave stale ones): the batches from there on rebuild them. A
seq that goes backwards with a payload other than the one applied for it means the pod's
publisher restarted: the pod's blocks are dropped and resynced from seq 0. A periodic check
(:mod:`.reconcile`) catches the rest: a restart not seen in the seq numbers, and drift.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict

import zmq
from zmq.utils.monitor import recv_monitor_message

from epdserve.connectors.kv_events import EventDecodeError, EventDecoder
from epdserve.connectors.kv_events.digest import StreamDigest
from epdserve.router.event_stream import HANDSHAKE_FAILED, EventSocketOptions, record_ingest
from epdserve.router.index import PrefixIndex
from epdserve.router.metrics import RouterMetrics
from epdserve.router.reconcile import RECONCILE_INTERVAL, Reconciler, healing_metrics, log_resync
from epdserve.router.seedcheck import RootHashCheck

log = logging.getLogger(__name__)
RECENT_SEQS = 4096  # payload fingerprints kept to tell replay duplicates from a restart
MAX_REPLAY_ROUNDS = 1000  # capped answers asked for in a row before giving up on the rest
RECONNECT_INTERVAL = 1.0  # s between our own reconnects after a dropped connection


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
        reconcile_interval: float = RECONCILE_INTERVAL,
    ) -> None:
        self.pod = pod
        self.options = options or EventSocketOptions()
        self._events, self.replay_endpoint = events_endpoint, replay_endpoint
        self._index, self.metrics = index, metrics
        self._root_check = root_check
        self.context = context or zmq.Context.instance()
        self.replay_timeout_ms = int(replay_timeout * 1000)
        self._decoder = EventDecoder()
        self._stop = threading.Event()
        self.last_seq: int | None = None
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> hash(payload)
        # the pod's blocks by the batches applied (None: unknown, after lost batches)
        self.digest: StreamDigest | None = StreamDigest()
        self._check = Reconciler(self, reconcile_interval)
        self.resyncs = 0
        healing_metrics(metrics).watch(index)
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
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 100_000)
        self.options.apply(sub)
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
                if self._check.due():
                    self._check.run()
        except zmq.ZMQError:
            self.metrics.events_invalid.labels(self.pod).inc()
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
            self.metrics.events_invalid.labels(self.pod).inc()
            log.exception("pod %s: failed to apply a KV event message", self.pod)

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.metrics.events_invalid.labels(self.pod).inc()
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.last_seq
        if last is not None and seq <= last:
            if self._recent.get(seq) == hash(frames[2]):
                self.duplicates += 1  # already applied (from a replay)
                return
            self.resync("restart", until=seq, detail=f"event seq went back {last} -> {seq}")
            if self.last_seq is not None and seq <= self.last_seq:
                return
        elif last is not None and seq > last + 1:
            self._catch_up(last + 1, until=seq)
            if self.last_seq is not None and seq <= self.last_seq:
                return
        self._accept(seq, frames[2])

    @property
    def next_seq(self) -> int:
        """The seq of the next batch to apply."""
        return 0 if self.last_seq is None else self.last_seq + 1

    def resync(self, reason: str, until: int | None = None, detail: str = "") -> None:
        """Drop the pod's entries and rebuild them by a replay from seq 0."""
        log_resync(self.metrics, self.pod, reason, detail or "replaying from seq 0")
        self.resyncs += 1
        self._index.clear_pod(self.pod)
        self._recent.clear()
        self.last_seq, self.digest = None, StreamDigest()
        if reason == "restart":
            self._check.instance = None  # a new publisher: the next check learns its id
        self._catch_up(0, until=until)

    def _accept(self, seq: int, payload: bytes) -> None:
        expected = self.next_seq
        if seq > expected:  # a publisher starts at 0: anything skipped is lost
            self._count_missed(seq - expected)
            self.digest = None  # the next check adopts the pod's
            if self.last_seq is not None:  # a lost removal leaves a stale entry: start over
                self._index.clear_pod(self.pod)
                detail = f"batches {expected}..{seq - 1} lost; rebuilding from {seq} on"
                log_resync(self.metrics, self.pod, "missed", detail)
        self.last_seq = seq
        self._recent[seq] = hash(payload)
        if len(self._recent) > RECENT_SEQS:
            self._recent.popitem(last=False)
        try:
            batch = self._decoder.decode(payload)
        except EventDecodeError:
            self.metrics.events_invalid.labels(self.pod).inc()
            self.digest = None  # its events are unknown: the check cannot compare
            return
        if self.digest is not None:
            self.digest.apply(batch.events)
        result = self._index.apply(self.pod, batch)
        record_ingest(self.metrics, self.pod, result, batch.events, self._root_check)
        self.batches_applied += 1

    def _count_missed(self, n: int) -> None:
        self.missed += n
        self.metrics.events_missed.labels(self.pod).inc(n)

    def catch_up(self, start: int, stop: int) -> None:
        """Apply the pod's batches ``start <= seq < stop`` by replay (the periodic check)."""
        self._catch_up(start, until=stop - 1, stop=stop)

    def poll_tail(self) -> str | None:
        """Replay what follows the last applied batch (the check of a pod without a
        digest): a pod that no longer holds that batch unchanged is another process."""
        return self._replay(self.next_seq)

    def _catch_up(self, start: int, until: int | None = None, stop: int | None = None) -> None:
        """Replay from ``start`` until an answer brings nothing new or ``until`` is reached
        (a pod caps each answer, so one request may not bring everything)."""
        for rounds in range(MAX_REPLAY_ROUNDS):
            before = self.last_seq
            outcome = self._replay(start, stop, anchored=rounds == 0)  # later: a checked run
            if outcome != "ok" or self.last_seq == before or self._stop.is_set():
                return
            if until is not None and self.last_seq >= until:
                return
            start = self.last_seq + 1

    def _replay(self, start: int, stop: int | None = None, anchored: bool = True) -> str | None:
        """Ask the replay socket for the batches from ``start`` on and apply those before
        ``stop``. Right after the last applied batch, the answer starts with that batch: a
        pod that lacks it or holds another restarted (resync; outcome ``restarted``)."""
        if not self.replay_endpoint:
            return None
        anchor = None
        if anchored and self.last_seq is not None and start == self.last_seq + 1:
            anchor, start = (self.last_seq, self._recent.get(self.last_seq)), self.last_seq
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        self.options.apply(dealer)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
            outcome = self._read_replay(dealer, stop, anchor)
        except zmq.ZMQError:
            outcome = "error"
        finally:
            dealer.close()
        self.metrics.replays.labels(self.pod, outcome).inc()
        if outcome == "restarted":
            self.resync("restart", detail=f"its replay no longer holds seq {start} as applied")
        return outcome

    def _read_replay(self, dealer: zmq.Socket, stop: int | None, anchor) -> str:
        while not self._stop.is_set():
            if not dealer.poll(self.replay_timeout_ms):
                return "timeout"
            frames = dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self.metrics.events_invalid.labels(self.pod).inc()
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return "ok" if anchor is None else "restarted"  # not even its last batch
            if seq < 0:
                self.metrics.events_invalid.labels(self.pod).inc()
                continue
            if anchor is not None:  # the first batch: the last one applied, unchanged?
                if seq == anchor[0] and hash(frames[3]) != anchor[1]:
                    return "restarted"
                anchor = None  # the same batch (or the pod dropped it long ago: go on)
            if (self.last_seq is None or seq > self.last_seq) and (stop is None or seq < stop):
                self._accept(seq, frames[3])
        return "stopped"
