"""Per-pod KV-event subscriber: SUB for live batches, replay on start and after a gap.

Batches are applied to the :class:`PrefixIndex` strictly in seq order. A seq gap asks the
pod's replay socket for what was lost; whatever the replay cannot return is counted as
missed. A seq that goes backwards with a payload other than the one applied for it means the
pod's publisher restarted: the pod's blocks are dropped and resynced from seq 0.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import zmq

from epdserve.connectors.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
)
from epdserve.router.index import IngestResult, PrefixIndex
from epdserve.router.metrics import RouterMetrics
from epdserve.router.seedcheck import RootHashCheck

log = logging.getLogger(__name__)
RECENT_SEQS = 4096  # payload fingerprints kept to tell replay duplicates from a restart


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
    ) -> None:
        self.pod = pod
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
        try:
            sub.connect(self._events)
            self._replay(0)
            while not self._stop.is_set():
                if sub.poll(100):
                    self._on_live_guarded(sub.recv_multipart())
        except zmq.ZMQError:
            self._metrics.events_invalid.labels(self.pod).inc()
            log.exception("KV event subscriber for %s stopped", self.pod)
        finally:
            sub.close()

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
            self._replay(0)
            if self.last_seq is not None and seq <= self.last_seq:
                return
        elif last is not None and seq > last + 1:
            self._replay(last + 1)
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

    def _replay(self, start: int) -> None:
        """Ask the replay socket for every batch from ``start`` on and apply them."""
        if not self._replay_endpoint:
            return
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
            outcome = self._read_replay(dealer)
        except zmq.ZMQError:
            outcome = "error"
        finally:
            dealer.close()
        self._metrics.replays.labels(self.pod, outcome).inc()

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
