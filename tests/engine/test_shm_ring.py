"""The shared-memory broadcast ring (engine/executor/shm_ring.py): every message reaches every
reader once and in order, in any size; waits end in TimeoutError or ConnectionError naming what
waited; a reader leaving never removes the writer's segment, and the writer's close does."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest

from epdserve.engine.executor.shm_ring import RingHandle, ShmRing

SPAWN = multiprocessing.get_context("spawn")
MiB = 1 << 20


def payload(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


def mixed_sizes(count: int) -> list[int]:
    """Sizes around the 1 MiB chunk edges, and a 5 MB (multi-fragment) message every 50th."""
    edges = [0, 17, 2048, 50_000, MiB - 1, MiB, MiB + 1]
    return [5_000_000 if i % 50 == 49 else edges[i % len(edges)] for i in range(count)]


def decode_handle(data: bytes) -> RingHandle:
    return msgspec.msgpack.decode(data, type=RingHandle)


def echo_digests(handle_bytes: bytes, rank: int, conn, count: int) -> None:
    """A reader process: reply to each message with its digest through a ring of its own."""
    with ShmRing.attach(decode_handle(handle_bytes), rank) as ring, ShmRing.create(1) as reply:
        conn.send_bytes(msgspec.msgpack.encode(reply.handle))
        for _ in range(count):
            message = ring.read(timeout=30)
            reply.write(hashlib.sha256(message).digest() + bytes([rank]), timeout=30)
        conn.recv_bytes()  # the core has read every reply: the segment may go


def read_one(handle_bytes: bytes) -> None:
    """A reader process that takes one message and leaves."""
    with ShmRing.attach(decode_handle(handle_bytes), 0) as ring:
        assert ring.read(timeout=30) == b"first"


def test_threads_get_every_message_in_order_across_fragments():
    sizes = [0, 1, 99, 100, 101, 250, 1000, 7, 300] * 6
    with ShmRing.create(2, chunk_bytes=100, n_chunks=3) as writer:
        readers = [ShmRing.attach(writer.handle, r) for r in range(2)]
        got: list[list[bytes]] = [[], []]

        def drain(r: int) -> None:
            got[r].extend(readers[r].read(timeout=10) for _ in sizes)

        threads = [threading.Thread(target=drain, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for i, size in enumerate(sizes):
            writer.write(payload(i, size), timeout=10)
        for t in threads:
            t.join(timeout=10)
        for reader in readers:
            reader.close()
    expected = [payload(i, size) for i, size in enumerate(sizes)]
    assert got == [expected, expected]


def test_reader_processes_get_200_mixed_messages_in_order_and_reply_through_their_rings():
    sizes = mixed_sizes(200)
    with ShmRing.create(2, chunk_bytes=MiB, n_chunks=8) as core:
        pipes = [SPAWN.Pipe() for _ in range(2)]
        procs = [
            SPAWN.Process(
                target=echo_digests,
                args=(msgspec.msgpack.encode(core.handle), r, pipes[r][1], len(sizes)),
            )
            for r in range(2)
        ]
        for p in procs:
            p.start()

        def workers_alive() -> bool:
            return all(p.is_alive() for p in procs)

        core.alive = workers_alive
        replies = []
        for conn, _ in pipes:
            assert conn.poll(30), "a reader process sent no reply-ring handle"
            handle = decode_handle(conn.recv_bytes())
            replies.append(ShmRing.attach(handle, 0, alive=workers_alive))
        for i, size in enumerate(sizes):
            message = payload(i, size)
            core.write(message, timeout=30)
            digest = hashlib.sha256(message).digest()
            assert [ring.read(timeout=30) for ring in replies] == [digest + b"\0", digest + b"\1"]
        for (conn, _), ring, p in zip(pipes, replies, procs, strict=True):
            ring.close()
            conn.send_bytes(b"done")
            p.join(timeout=30)
            assert p.exitcode == 0


def test_a_write_times_out_naming_the_reader_that_never_reads():
    with ShmRing.create(2, chunk_bytes=64, n_chunks=2) as writer:
        reader0 = ShmRing.attach(writer.handle, 0)
        for i in range(2):
            writer.write(payload(i, 10), timeout=1)
            assert reader0.read(timeout=1) == payload(i, 10)
        with pytest.raises(
            TimeoutError, match=r"ring write: reader 1 has not read chunk 0 in 0.1 s"
        ):
            writer.write(b"third", timeout=0.1)
        reader0.close()


def test_a_read_times_out_naming_the_reader_and_chunk():
    expected = r"ring read \(reader 1\): chunk 0 not written in 0.1 s"
    writer = ShmRing.create(2, chunk_bytes=64, n_chunks=2)
    with (
        writer,
        ShmRing.attach(writer.handle, 1) as reader,
        pytest.raises(TimeoutError, match=expected),
    ):
        reader.read(timeout=0.1)


def test_a_read_that_timed_out_mid_message_resumes_it():
    with ShmRing.create(2, chunk_bytes=10, n_chunks=2) as writer:
        reader0, reader1 = (ShmRing.attach(writer.handle, r) for r in range(2))
        message = payload(1, 25)  # 3 fragments: the third waits for reader 1 to free chunk 0
        thread = threading.Thread(target=writer.write, args=(message, 10))
        thread.start()
        with pytest.raises(TimeoutError, match=r"reader 0\): chunk 0 not written"):
            reader0.read(timeout=0.5)  # takes fragments 1 and 2, then waits
        assert reader1.read(timeout=10) == message
        assert reader0.read(timeout=10) == message
        thread.join(timeout=10)
        reader0.close()
        reader1.close()


def test_a_write_that_stopped_mid_message_refuses_the_next():
    with ShmRing.create(1, chunk_bytes=10, n_chunks=2) as writer:
        with pytest.raises(TimeoutError):
            writer.write(payload(1, 35), timeout=0.05)  # two fragments in, no reader
        with pytest.raises(RuntimeError, match="stopped mid-message"):
            writer.write(b"next", timeout=1)


@pytest.mark.parametrize("side", ["writer", "reader"])
def test_a_dead_peer_raises_connection_error_naming_the_check(side):
    def worker_alive() -> bool:
        return False

    writer = ShmRing.create(1, chunk_bytes=64, n_chunks=1)
    with writer, ShmRing.attach(writer.handle, 0) as reader:
        if side == "writer":
            writer.write(b"unread", timeout=1)
            writer.alive = worker_alive
            call = lambda: writer.write(b"blocked", timeout=None)  # noqa: E731
        else:
            reader.alive = worker_alive
            call = lambda: reader.read(timeout=None)  # noqa: E731
        with pytest.raises(ConnectionError, match=r"worker_alive\(\) says the peer is gone"):
            call()


def test_a_reader_process_leaving_keeps_the_segment_and_the_writer_close_removes_it():
    code = (
        "import sys, msgspec\n"
        "from epdserve.engine.executor.shm_ring import RingHandle, ShmRing\n"
        "handle = msgspec.msgpack.decode(bytes.fromhex(sys.argv[1]), type=RingHandle)\n"
        "ring = ShmRing.attach(handle, 0)\n"
        "print(ring.read(timeout=30).decode())\n"
    )  # no close: the process just exits, its own resource tracker with it
    writer = ShmRing.create(2, chunk_bytes=64, n_chunks=4)
    reader1 = ShmRing.attach(writer.handle, 1)
    writer.write(b"first", timeout=1)
    encoded = msgspec.msgpack.encode(writer.handle).hex()
    child = subprocess.run(
        [sys.executable, "-c", code, encoded], capture_output=True, text=True, timeout=60
    )
    assert (child.returncode, child.stdout, child.stderr) == (0, "first\n", "")
    assert Path("/dev/shm", writer.handle.name).exists()
    for i in range(3):
        writer.write(payload(i, 50), timeout=1)
    assert [reader1.read(timeout=1) for _ in range(4)] == [b"first"] + [
        payload(i, 50) for i in range(3)
    ]
    ShmRing.attach(writer.handle, 1).close()  # still there by name
    writer.close()
    writer.close()  # idempotent
    assert not Path("/dev/shm", writer.handle.name).exists()
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(writer.handle, 0)
    reader1.close()
    reader1.close()


def test_readers_sharing_the_writers_resource_tracker_leave_it_no_complaint():
    # an in-process reader and a 'spawn' child share the writer's tracker: unregistering their
    # attach there would also drop the writer's entry, and its unlink would print a KeyError
    code = (
        "import multiprocessing, sys, msgspec\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_shm_ring\n"
        "from epdserve.engine.executor.shm_ring import ShmRing\n"
        "if __name__ == '__main__':\n"
        "    writer = ShmRing.create(1)\n"
        "    ShmRing.attach(writer.handle, 0).close()\n"
        "    handle = msgspec.msgpack.encode(writer.handle)\n"
        "    child = multiprocessing.get_context('spawn').Process(\n"
        "        target=test_shm_ring.read_one, args=(handle,))\n"
        "    child.start()\n"
        "    writer.write(b'first', timeout=30)\n"
        "    child.join(30)\n"
        "    writer.close()\n"
        "    sys.exit(child.exitcode)\n"
    )
    script = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert (script.returncode, script.stderr) == (0, "")


def test_attach_checks_the_handle_against_the_segment():
    with ShmRing.create(2, chunk_bytes=64, n_chunks=2) as writer:
        with pytest.raises(ValueError, match="reader_index"):
            ShmRing.attach(writer.handle, 2)
        wrong = RingHandle(writer.handle.name, 2, 128, 2)
        with pytest.raises(ValueError, match="not a ring"):
            ShmRing.attach(wrong, 0)
    with pytest.raises(ValueError, match="n_chunks"):
        ShmRing.create(1, n_chunks=0)
    assert not os.path.exists(f"/dev/shm/{writer.handle.name}")
