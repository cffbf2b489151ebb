"""What one step's broadcast costs through the shared-memory ring (engine/executor/shm_ring.py)
against ``multiprocessing.Pipe`` and zmq PAIR sockets, side by side in one run (prints JSON).

The core process sends a message to 2 worker processes (the ring: one write that both read;
a pipe or socket: one send per worker) and each worker replies 200 bytes (the ring: through a
reply ring of its own). Three figures per transport:

- ``round_trip_us``: a 2 KB message and both replies, median and p99 over ``--rounds``.
- ``mb_per_s``: a 10 MB message (an image step's pixels) to both workers and both replies.
- ``idle_cpu_pct``: a worker's CPU while it waits ``--idle`` s for the next message.

Transports run in alternating order over ``--reps``, so drift in the machine hits all alike.

    .venv/bin/python bench/shm_ring.py [--rounds 2000] [--big-rounds 20] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import struct
import tempfile
import time

import msgspec
import zmq

from epdserve.engine.executor.shm_ring import SPIN_SECONDS, RingHandle, ShmRing

WORKERS = 2
TIMEOUT = 30.0
REPLY = struct.Struct("<d192x")  # 200 bytes: the CPU seconds the worker's last wait took
STOP = b""
TRANSPORTS = ("ring", "pipe", "zmq")


def serve(kind: str, rank: int, conn, address: str, handle: bytes) -> None:
    """A worker: answer each message with a 200-byte reply until an empty one comes."""
    if kind == "ring":
        ring = ShmRing.attach(msgspec.msgpack.decode(handle, type=RingHandle), rank)
        reply_ring = ShmRing.create(1)
        conn.send_bytes(msgspec.msgpack.encode(reply_ring.handle))
        recv, send = (lambda: ring.read(TIMEOUT)), (lambda b: reply_ring.write(b, TIMEOUT))
    elif kind == "pipe":
        recv, send = conn.recv_bytes, conn.send_bytes
    else:
        sock = zmq.Context.instance().socket(zmq.PAIR)
        sock.connect(address)
        recv, send = sock.recv, sock.send
    while True:
        cpu = time.process_time()
        message = recv()
        send(REPLY.pack(time.process_time() - cpu))
        if message == STOP:
            break
    if kind == "ring":
        conn.recv_bytes()  # the core has read the last reply
        ring.close()
        reply_ring.close()


class Core:
    """The core's end of one transport to ``WORKERS`` worker processes."""

    def __init__(self, kind: str, tmp: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.kind = kind
        self.conns, children = zip(*(ctx.Pipe() for _ in range(WORKERS)), strict=True)
        addresses = [f"ipc://{tmp}/{kind}-{r}" for r in range(WORKERS)]
        handle = b""
        if kind == "ring":
            self.ring = ShmRing.create(WORKERS)
            handle = msgspec.msgpack.encode(self.ring.handle)
        if kind == "zmq":
            self.socks = [zmq.Context.instance().socket(zmq.PAIR) for _ in range(WORKERS)]
            for sock, address in zip(self.socks, addresses, strict=True):
                sock.bind(address)
        self.procs = [
            ctx.Process(target=serve, args=(kind, r, children[r], addresses[r], handle))
            for r in range(WORKERS)
        ]
        for p in self.procs:
            p.start()
        if kind == "ring":
            handles = [msgspec.msgpack.decode(c.recv_bytes(), type=RingHandle) for c in self.conns]
            self.replies = [ShmRing.attach(h, 0) for h in handles]

    def round_trip(self, message: bytes) -> list[float]:
        """Send ``message`` to every worker; the CPU seconds each says its wait took."""
        if self.kind == "ring":
            self.ring.write(message, TIMEOUT)
            replies = [r.read(TIMEOUT) for r in self.replies]
        elif self.kind == "pipe":
            for c in self.conns:
                c.send_bytes(message)
            replies = [c.recv_bytes() for c in self.conns]
        else:
            for s in self.socks:
                s.send(message, copy=len(message) < 65536)
            replies = [s.recv() for s in self.socks]
        return [REPLY.unpack(r)[0] for r in replies]

    def close(self) -> None:
        self.round_trip(STOP)
        if self.kind == "ring":
            for conn, reply in zip(self.conns, self.replies, strict=True):
                reply.close()
                conn.send_bytes(b"done")
            self.ring.close()
        for p in self.procs:
            p.join(TIMEOUT)
        if self.kind == "zmq":
            for s in self.socks:
                s.close(linger=0)


def timed(core: Core, message: bytes, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        core.round_trip(message)
        times.append(time.perf_counter() - t)
    return times


def measure(kind: str, tmp: str, args) -> dict:
    core = Core(kind, tmp)
    small, big = os.urandom(2048), os.urandom(10_000_000)
    timed(core, small, 200)  # warm up
    lat = timed(core, small, args.rounds)
    thr = timed(core, big, args.big_rounds)
    time.sleep(args.idle)
    idle_cpu = max(core.round_trip(small))
    core.close()
    return {"lat": lat, "thr": thr, "idle_cpu": idle_cpu}


def summary(runs: list[dict], idle: float) -> dict:
    lat = sorted(t for r in runs for t in r["lat"])
    thr = [t for r in runs for t in r["thr"]]
    return {
        "round_trip_us": {
            "median": round(statistics.median(lat) * 1e6, 1),
            "p99": round(lat[int(len(lat) * 0.99)] * 1e6, 1),
        },
        "mb_per_s": round(10.0 / statistics.median(thr), 1),
        "idle_cpu_pct": round(100 * max(r["idle_cpu"] for r in runs) / idle, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--big-rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--idle", type=float, default=1.0)
    args = ap.parse_args()

    runs: dict[str, list[dict]] = {k: [] for k in TRANSPORTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = TRANSPORTS if rep % 2 == 0 else TRANSPORTS[::-1]
            for kind in order:
                runs[kind].append(measure(kind, tmp, args))
    result = {k: summary(v, args.idle) for k, v in runs.items()}
    ring = result["ring"]
    print(
        json.dumps(
            {
                "bench": "shm_ring",
                "cpus": os.cpu_count(),
                "workers": WORKERS,
                "spin_us": SPIN_SECONDS * 1e6,
                "round_trips": args.rounds * args.reps,
                "big_message_mb": 10,
                **result,
                "ring_speedup": {  # other / ring for latency, ring / other for MB/s
                    k: {
                        "round_trip_median": round(
                            result[k]["round_trip_us"]["median"] / ring["round_trip_us"]["median"],
                            2,
                        ),
                        "mb_per_s": round(ring["mb_per_s"] / result[k]["mb_per_s"], 2),
                    }
                    for k in ("pipe", "zmq")
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
