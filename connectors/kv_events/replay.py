"""Replay of buffered event batches over a ROUTER socket, on a thread of its own.

Wire (vLLM 0.32): a DEALER sends ``[b"", start_seq]``; each buffered batch with
``seq >= start`` comes back as ``[b"", topic, seq, payload]``, then the end marker
``[b"", b"", seq -1, b""]``. Bounds of ours: an answer holds at most ``max_batches``
batches (a client asks again from the next seq), a peer has one replay in flight, at most
``max_in_flight`` peers are served at once, and answers go out in small slices, peer by
peer, so a flood of replays never holds up the publisher thread's live batches. A start seq
of ``DIGEST_REQUEST`` asks for the stream's digest instead (see :mod:`.digest`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from epdserve.connectors.kv_events.curve import CurveServer
from epdserve.connectors.kv_events.digest import DIGEST_REQUEST
from epdserve.connectors.kv_events.sockets import MAX_REQUEST_BYTES, attach, pin_io_thread

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SLICE = 16  # batches sent to one peer before the next peer's turn
TURN = 0.001  # s of sending before the thread rests twice as long (a third of a core)
REST = 2.0
SNDHWM = 128  # messages queued per peer: bounds the memory a slow reader can hold
STALL_TIMEOUT = 10.0  # s a peer may read nothing before its replay is dropped
MAX_REQUEST_FRAMES = 3  # identity, delimiter, start seq


class ReplayBuffer:
    """The last ``capacity`` payloads by seq (consecutive from 0); the publisher thread
    appends, the replay thread reads."""

    def __init__(self, capacity: int) -> None:
        self._ring: list[bytes] = [b""] * capacity
        self._capacity = capacity
        self._next = 0
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._ring[seq % self._capacity] = payload
            self._next = seq + 1

    def bounds(self) -> tuple[int, int]:
        """``(first, next)``: the seqs held are ``first..next-1``."""
        with self._lock:
            return max(0, self._next - self._capacity), self._next

    def read(self, start: int, stop: int, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` held batches with ``start <= seq < stop``, from the lowest."""
        with self._lock:
            first = max(start, self._next - self._capacity, 0)
            last = min(stop, self._next, first + limit)
            return [(s, self._ring[s % self._capacity]) for s in range(first, last)]


@dataclass
class _Replay:
    next_seq: int
    stop: int  # exclusive
    last_progress: float


class ReplayServer:
    """Serves replay requests from ``buffer`` on its own thread (see the module doc)."""

    def __init__(
        self,
        endpoint: str,
        buffer: ReplayBuffer,
        topic: bytes,
        stats,
        context: zmq.Context,
        max_batches: int = 1_000,
        max_in_flight: int = 64,
        pod_ip: str | None = None,
        curve: CurveServer | None = None,
        digest: Callable[[], bytes] | None = None,
    ) -> None:
        self._endpoint, self._buffer, self._topic = endpoint, buffer, topic
        self._stats, self._context, self._curve = stats, context, curve
        self._max_batches, self._max_in_flight, self._pod_ip = max_batches, max_in_flight, pod_ip
        self._digest = digest
        self._active: OrderedDict[bytes, _Replay] = OrderedDict()
        self._stop = threading.Event()
        self._ready, self._error = threading.Event(), None
        self.address: str | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-replay", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            self._thread.join(5)
            raise self._error

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _open(self) -> zmq.Socket:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer raises, never drops
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        pin_io_thread(sock, self._context, 1)
        if self._curve is not None:
            self._curve.apply(sock)
        try:
            self.address = attach(sock, self._endpoint, self._pod_ip, "replay ROUTER")
        except zmq.ZMQError:
            sock.close()
            raise
        return sock

    def _run(self) -> None:
        try:
            sock = self._open()
        except zmq.ZMQError as exc:
            self._error = ValueError(f"kv-events-config: cannot open replay_endpoint: {exc}")
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(0 if self._active else 50):
                    self._take_requests(sock)
                if self._active:
                    start = time.perf_counter()
                    progressed = self._serve_turn(sock)
                    # rest after sending: the GIL and a core stay free for the engine loop
                    # and the live publisher (or every peer is full: let them read)
                    busy = time.perf_counter() - start
                    time.sleep(max(busy * REST, 0.001) if progressed else 0.002)
        finally:
            sock.close()

    # --- requests -----------------------------------------------------------------------

    def _take_requests(self, sock: zmq.Socket) -> None:
        for _ in range(256):  # then serve a round: requests cannot starve answers
            try:
                frames = _recv_bounded(sock)
            except zmq.Again:
                return
            self._stats.replay_requests += 1
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self._stats.replay_requests_invalid += 1
                continue
            identity = frames[0]
            if frames[2] == DIGEST_REQUEST and self._digest is not None:
                self._answer_digest(sock, identity)
                continue
            if identity in self._active:
                self._stats.replay_requests_busy += 1  # one in flight per peer
                continue
            if len(self._active) >= self._max_in_flight:
                self._stats.replay_requests_refused += 1
                continue
            first, nxt = self._buffer.bounds()
            begin = max(int.from_bytes(frames[2], "big", signed=True), first)
            stop = min(nxt, begin + self._max_batches)
            if stop < nxt:
                self._stats.replay_answers_capped += 1
            self._active[identity] = _Replay(begin, max(stop, begin), time.monotonic())

    def _answer_digest(self, sock: zmq.Socket, identity: bytes) -> None:
        self._stats.digest_requests += 1
        frames = (identity, b"", b"", DIGEST_REQUEST, self._digest())
        with contextlib.suppress(zmq.ZMQError):  # gone or full: it asks again later
            sock.send_multipart(frames, flags=zmq.NOBLOCK)

    # --- answers ------------------------------------------------------------------------

    def _serve_turn(self, sock: zmq.Socket) -> bool:
        """A slice to each active peer in turn, for about TURN seconds (the peers served go
        to the back of the line); False when nothing could be sent."""
        progressed = False
        start = time.perf_counter()
        now = time.monotonic()
        for identity in list(self._active):
            replay = self._active[identity]
            sent, done = self._serve_slice(sock, identity, replay)
            if sent:
                progressed, replay.last_progress = True, now
            if done:
                del self._active[identity]
            elif now - replay.last_progress > STALL_TIMEOUT:
                del self._active[identity]
                self._stats.replay_stalled += 1
            else:
                self._active.move_to_end(identity)
            if time.perf_counter() - start > TURN:
                break
        return progressed

    def _serve_slice(self, sock: zmq.Socket, identity: bytes, replay: _Replay) -> tuple[int, bool]:
        """Send the next batches of one answer: (messages sent, answer finished)."""
        sent = 0
        try:
            for seq, payload in self._buffer.read(replay.next_seq, replay.stop, SLICE):
                frames = (identity, b"", self._topic, seq.to_bytes(8, "big"), payload)
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                replay.next_seq = seq + 1
                sent += 1
                self._stats.replay_batches_sent += 1
            if sent == 0 or replay.next_seq >= replay.stop:
                # nothing left below ``stop`` (the rest may have been overwritten meanwhile)
                sock.send_multipart((identity, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
                return sent + 1, True
        except zmq.Again:  # this peer's queue is full: its turn again next round
            return sent, False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                log.warning("KV event replay to a peer failed: %s", exc)
            return sent, True  # the peer is gone
        return sent, False


def _recv_bounded(sock: zmq.Socket) -> list[bytes]:
    """One message, at most MAX_REQUEST_FRAMES + 1 frames kept (the rest are read and
    dropped, so a peer cannot make us hold many frames)."""
    frames = [sock.recv(zmq.NOBLOCK)]
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv()
        if len(frames) <= MAX_REQUEST_FRAMES:
            frames.append(frame)
    return frames
