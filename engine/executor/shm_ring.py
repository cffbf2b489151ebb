"""A shared-memory broadcast ring (DESIGN.md §10): one writer process, ``n_readers`` reader
processes, every message delivered once to each reader, in order. The multi-process executor
sends each step's bytes to every rank through one, and each rank replies through its own (one
writer, one reader).

Segment layout: a 64-byte prelude (magic and geometry, checked on attach), then ``n_chunks``
chunks, each a header and ``chunk_bytes`` of payload. Header: payload length (u64), "more
fragments follow" (u8), written (u8), then one read flag (u8) per reader. A message larger
than a chunk goes out as consecutive fragments. The writer reuses a chunk only once every
reader has set its read flag; reader ``r`` takes a chunk once it is written and flag ``r`` is
clear. Nothing here pickles: payloads are bytes, the handle is a msgspec Struct.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import msgspec

# Poll this long before sleeping (a decode step is ~1-5 ms, so gaps must be cheap), yielding
# the CPU between polls: on 2 cores shared by the core and two workers, a pure busy-poll kept
# the writer off a core and a 2 KB round trip took ~500 us instead of ~15 us (bench/shm_ring.py).
SPIN_SECONDS = 300e-6
SLEEP_FIRST = 20e-6  # then sleep, doubling from this ...
SLEEP_MAX = 1e-3  # ... to this, so an idle reader costs close to no CPU
SLEEP_BUSY = 100e-6  # ... or to this, for a wait that ends soon (``ShmRing.max_sleep``)
ALIVE_EVERY = 0.05  # seconds between ``alive()`` checks while waiting

MAGIC = b"EPDRING1"
PRELUDE = struct.Struct("<8sQQQ")  # magic, n_readers, chunk_bytes, n_chunks
PRELUDE_BYTES = 64
LENGTH = struct.Struct("<QB")  # payload length, more fragments follow
WRITTEN_AT = 9  # header offset of the written flag
FLAGS_AT = 16  # header offset of reader 0's read flag
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory segments by name

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """Order this process's earlier loads and stores before its later ones. Python has no
    fence; taking a lock is an atomic read-modify-write (``lock``-prefixed on x86, acquire and
    release barriers on ARM), so payload bytes are visible before the flag that publishes them.
    On x86 stores already stay in order; this keeps weaker CPUs correct for ~0.1 us a call."""
    _fence_lock.acquire()
    _fence_lock.release()


class RingHandle(msgspec.Struct, frozen=True):
    """What a reader process needs to attach (send it as msgspec bytes)."""

    name: str
    n_readers: int
    chunk_bytes: int
    n_chunks: int

    @property
    def header_bytes(self) -> int:
        return -(-(FLAGS_AT + self.n_readers) // 64) * 64

    @property
    def stride(self) -> int:
        return self.header_bytes + -(-self.chunk_bytes // 64) * 64

    @property
    def segment_bytes(self) -> int:
        return PRELUDE_BYTES + self.n_chunks * self.stride


def _validate(n_readers: int, chunk_bytes: int, n_chunks: int) -> None:
    fields = {"n_readers": n_readers, "chunk_bytes": chunk_bytes, "n_chunks": n_chunks}
    for field, value in fields.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}: must be a positive int, got {value!r}")


def _map_existing(name: str) -> mmap.mmap:
    # Readers map the segment themselves instead of attaching a SharedMemory: on Python < 3.13
    # that registers the name with the resource tracker, and unregistering it again (the usual
    # fix) also drops the writer's entry when both share one tracker (the same process, or a
    # 'spawn' child), after which the writer's unlink makes the tracker print a KeyError.
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


class ShmRing:
    """One end of a ring: the writer (``create``) or reader ``reader_index`` (``attach``).

    ``alive``, when given, is called every ``ALIVE_EVERY`` s while waiting; once it returns
    False the wait raises ``ConnectionError`` (the peer died). Timeouts raise ``TimeoutError``.
    Both name what was waited for. Not thread-safe: one thread per end."""

    def __init__(self, handle, mapping, buf, reader_index, owner, alive) -> None:
        self.handle: RingHandle = handle
        self.reader_index: int | None = reader_index  # None on the writer
        self.alive: Callable[[], bool] | None = alive
        self._mapping = mapping  # the SharedMemory (writer) or the mmap (reader)
        self._buf: memoryview | None = buf
        self._owner = owner
        self._seq = 0  # chunks written (writer) or taken (reader) so far
        self._parts: list[bytes] = []  # fragments of a message a timed-out read began
        self._broken = False  # a write stopped mid-message: readers hold a partial one
        self._all_read = b"\x01" * handle.n_readers
        # the longest sleep between polls: a waiter that expects its message soon (the core
        # waiting on a step, a rank between steps) sets a short one, an idle one the default
        self.max_sleep = SLEEP_MAX

    @classmethod
    def create(
        cls,
        n_readers: int,
        chunk_bytes: int = 1 << 20,
        n_chunks: int = 8,
        name: str | None = None,
        *,
        alive: Callable[[], bool] | None = None,
    ) -> ShmRing:
        """Create the segment and return its writer end, which unlinks it on ``close``."""
        _validate(n_readers, chunk_bytes, n_chunks)
        size = RingHandle("", n_readers, chunk_bytes, n_chunks).segment_bytes
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        handle = RingHandle(shm.name, n_readers, chunk_bytes, n_chunks)
        PRELUDE.pack_into(shm.buf, 0, MAGIC, n_readers, chunk_bytes, n_chunks)  # rest: zeros
        return cls(handle, shm, shm.buf, None, True, alive)

    @classmethod
    def attach(
        cls, handle: RingHandle, reader_index: int, *, alive: Callable[[], bool] | None = None
    ) -> ShmRing:
        """Map the segment ``handle`` names as reader ``reader_index``; FileNotFoundError once
        the writer has unlinked it."""
        _validate(handle.n_readers, handle.chunk_bytes, handle.n_chunks)
        if not isinstance(reader_index, int) or not 0 <= reader_index < handle.n_readers:
            raise ValueError(f"reader_index: {reader_index!r} not in [0, {handle.n_readers})")
        mapping = _map_existing(handle.name)
        got = PRELUDE.unpack_from(mapping, 0) if len(mapping) >= PRELUDE.size else None
        want = (MAGIC, handle.n_readers, handle.chunk_bytes, handle.n_chunks)
        if got != want or len(mapping) < handle.segment_bytes:
            mapping.close()
            raise ValueError(f"handle: segment {handle.name!r} holds {got}, not a ring {want}")
        return cls(handle, mapping, memoryview(mapping), reader_index, False, alive)

    # -- writer -------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview, timeout: float | None) -> None:
        """Send ``data`` to every reader (in fragments if it exceeds a chunk); waits at most
        ``timeout`` s in all for readers to free chunks. A failure after the first fragment
        leaves readers with part of a message, so the ring then refuses further writes."""
        buf = self._open_buf("write")
        if self.reader_index is not None:
            raise RuntimeError(f"ring write: this end is reader {self.reader_index}")
        if self._broken:
            raise RuntimeError("ring write: an earlier write stopped mid-message")
        view = memoryview(data).cast("B")
        deadline = None if timeout is None else time.monotonic() + timeout
        h, pos, sent = self.handle, 0, False
        while not sent or pos < len(view):
            chunk = self._seq % h.n_chunks
            at = PRELUDE_BYTES + chunk * h.stride
            try:
                self._wait(self._chunk_free, self._write_wait, chunk, deadline, timeout)
            except (TimeoutError, ConnectionError):
                self._broken = sent
                raise
            n = min(h.chunk_bytes, len(view) - pos)
            body = at + h.header_bytes
            buf[body : body + n] = view[pos : pos + n]
            pos += n
            LENGTH.pack_into(buf, at, n, pos < len(view))
            memory_fence()  # payload and length before the flags that publish them
            buf[at + FLAGS_AT : at + FLAGS_AT + h.n_readers] = bytes(h.n_readers)
            buf[at + WRITTEN_AT] = 1
            self._seq += 1
            sent = True

    def _chunk_free(self, at: int) -> bool:
        """Every reader has read chunk ``at`` (or it was never written)."""
        buf = self._buf
        flags = buf[at + FLAGS_AT : at + FLAGS_AT + self.handle.n_readers]
        return flags == self._all_read or not buf[at + WRITTEN_AT]

    def _write_wait(self, chunk: int) -> str:
        at = PRELUDE_BYTES + chunk * self.handle.stride
        flags = self._buf[at + FLAGS_AT : at + FLAGS_AT + self.handle.n_readers]
        lagging = next((r for r, f in enumerate(flags) if not f), 0)
        return f"ring write: reader {lagging} has not read chunk {chunk}"

    # -- reader -------------------------------------------------------------------------

    def read(self, timeout: float | None) -> bytes:
        """The next message (a copy). A timeout keeps the fragments taken so far, so the next
        ``read`` resumes the same message."""
        buf = self._open_buf("read")
        r = self.reader_index
        if r is None:
            raise RuntimeError("ring read: this end is the writer")
        deadline = None if timeout is None else time.monotonic() + timeout
        h = self.handle
        while True:
            chunk = self._seq % h.n_chunks
            at = PRELUDE_BYTES + chunk * h.stride
            flag = at + FLAGS_AT + r
            self._wait(self._chunk_ready, self._read_wait, chunk, deadline, timeout)
            memory_fence()  # the flags before the payload they publish
            n, more = LENGTH.unpack_from(buf, at)
            body = at + h.header_bytes
            part = bytes(buf[body : body + n])
            memory_fence()  # the copy is done before the writer may reuse the chunk
            buf[flag] = 1
            self._seq += 1
            if not more and not self._parts:
                return part
            self._parts.append(part)
            if not more:
                message, self._parts = b"".join(self._parts), []
                return message

    def _chunk_ready(self, at: int) -> bool:
        """Chunk ``at`` is written and this reader has not taken it yet."""
        buf = self._buf
        return bool(buf[at + WRITTEN_AT]) and not buf[at + FLAGS_AT + self.reader_index]

    def _read_wait(self, chunk: int) -> str:
        return f"ring read (reader {self.reader_index}): chunk {chunk} not written"

    # -- both ---------------------------------------------------------------------------

    def _open_buf(self, op: str) -> memoryview:
        if self._buf is None:
            raise ValueError(f"ring {op}: the ring is closed")
        return self._buf

    def _wait(self, ready, waiting_for, chunk: int, deadline, timeout) -> None:
        """Return once ``ready(at)`` for ``chunk``: poll ``SPIN_SECONDS``, then sleep with
        backoff; ``waiting_for(chunk)`` names the wait in a TimeoutError or ConnectionError."""
        at = PRELUDE_BYTES + chunk * self.handle.stride
        if ready(at):
            return
        now = time.monotonic()
        spin_until, next_alive, sleep = now + SPIN_SECONDS, now + ALIVE_EVERY, SLEEP_FIRST
        while not ready(at):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"{waiting_for(chunk)} in {timeout} s")
            if self.alive is not None and now >= next_alive:
                next_alive = now + ALIVE_EVERY
                if not self.alive():
                    name = getattr(self.alive, "__name__", repr(self.alive))
                    raise ConnectionError(f"{waiting_for(chunk)}: {name}() says the peer is gone")
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, self.max_sleep)

    def close(self) -> None:
        """Unmap the segment; the writer also unlinks it. Idempotent."""
        if self._buf is None:
            return
        self._buf.release()
        self._buf = None
        self._mapping.close()
        if self._owner:
            self._mapping.unlink()

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
