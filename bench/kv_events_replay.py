"""Replay flood vs live KV events: how late do live batches arrive while replays are served?

An engine-like process publishes live event batches on a fixed step interval (its main
thread also burns ``--step-work-ms`` of Python per step, as an engine loop holds the GIL)
from a publisher whose replay buffer is full (``--buffer`` batches). A subscriber in this
process measures each live batch's delay (receive time minus the publish call's time).
Two phases, same run: quiet, then ``--dealers`` replay DEALERs in another process asking
again and again from seq 0 (``--once``: one request each). Prints one JSON object: delay p50/p99/max per phase, the flood's
replay throughput, the step loop's lateness, and the publisher's counters.

    .venv/bin/python bench/kv_events_replay.py [--dealers 40] [--buffer 10000]
        [--interval-ms 20] [--phase-s 5] [--step-work-ms 5] [--curve]
        [--publisher-module FILE]   # another ZmqEventPublisher (e.g. an older one) side by side
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)
BS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def make_keys(directory: Path) -> None:
    pairs = {"server": zmq.curve_keypair(), "client": zmq.curve_keypair()}
    for name, (public, secret) in pairs.items():
        (directory / f"{name}.public").write_bytes(public)
        (directory / f"{name}.secret").write_bytes(secret)


def stored(i: int, blocks: int):
    from epdserve.connectors.kv_events import BlockStored

    hashes = [(i * 131 + b) & ((1 << 64) - 1) for b in range(blocks)]
    tokens = [(i + t) % 4000 for t in range(blocks * BS)]
    return BlockStored(hashes, i, tokens, BS, None, "GPU", None, [None] * blocks, 0)


def publisher_class(module_file: str | None):
    if not module_file:
        from epdserve.connectors.kv_events import ZmqEventPublisher

        return ZmqEventPublisher
    spec = importlib.util.spec_from_file_location("other_publisher", module_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.ZmqEventPublisher


def engine(args, ports, keydir, ready, flood_on, stop, done, out) -> None:
    """The engine stand-in: fill the buffer, then one live batch per step until ``done``."""
    cls = publisher_class(args.publisher_module)
    kwargs = {"buffer_steps": args.buffer}
    if keydir:
        from epdserve.connectors.kv_events import CurveServerKeys

        kwargs["curve_keys"] = CurveServerKeys.load(keydir)
    if not args.publisher_module:
        kwargs["pod_ip"] = "127.0.0.1"
    pub = cls(f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}", "kv@bench", **kwargs)
    for i in range(args.buffer):
        pub.publish([stored(i, args.blocks)])
        if i % 1000 == 999:
            time.sleep(0.05)  # let the publisher thread keep up (its queue is bounded)
    while pub.stats.batches_published < args.buffer:
        time.sleep(0.05)
    ready.set()
    interval, work = args.interval_ms / 1000, args.step_work_ms / 1000
    late = {"quiet": [], "flood": [], "after": []}
    next_tick, i = time.perf_counter(), args.buffer
    while not done.is_set():
        now = time.perf_counter()
        phase = "after" if stop.is_set() else "flood" if flood_on.is_set() else "quiet"
        late[phase].append(now - next_tick)
        pub.publish([stored(i, args.blocks)])
        i += 1
        end = time.perf_counter() + work
        while time.perf_counter() < end:  # the engine's own Python work holds the GIL
            pass
        next_tick += interval
        time.sleep(max(0.0, next_tick - time.perf_counter()))
    stats = {k: v for k, v in vars(pub.stats).items() if isinstance(v, int)}
    pub.close()
    out.put({"late": late, "stats": stats})


def flooder(args, port, keydir, stop, out) -> None:
    """``--dealers`` DEALERs, each asking from seq 0 (again as soon as its answer ends,
    unless ``--once``)."""
    ctx = zmq.Context()
    keys = None
    if keydir:
        from epdserve.connectors.kv_events import CurveClientKeys

        keys = CurveClientKeys.load(keydir)
    dealers = []
    for _ in range(args.dealers):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        if keys:
            keys.apply(d)
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        dealers.append(d)
    poller = zmq.Poller()
    for d in dealers:
        poller.register(d, zmq.POLLIN)
    batches = answers = 0
    while not stop.is_set():
        for sock, _ in poller.poll(100):
            while sock.poll(0):
                frames = sock.recv_multipart()
                if len(frames) == 4 and frames[2] == END:
                    answers += 1
                    if not args.once:
                        sock.send_multipart([b"", (0).to_bytes(8, "big")])
                else:
                    batches += 1
    for d in dealers:
        d.close()
    ctx.term()
    out.put({"replay_batches_received": batches, "replay_answers_completed": answers})


def summary(delays: list[float]) -> dict:
    ms = [d * 1000 for d in delays]
    return {
        "batches": len(ms),
        "p50_ms": round(percentile(ms, 0.5), 2),
        "p99_ms": round(percentile(ms, 0.99), 2),
        "max_ms": round(max(ms, default=0.0), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dealers", type=int, default=40)
    p.add_argument("--buffer", type=int, default=10_000)
    p.add_argument("--blocks", type=int, default=4, help="blocks per BlockStored batch")
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--step-work-ms", type=float, default=5.0)
    p.add_argument("--phase-s", type=float, default=5.0)
    p.add_argument("--drain-s", type=float, default=3.0, help="s to wait for late batches")
    p.add_argument("--once", action="store_true", help="each DEALER asks once, not again")
    p.add_argument("--curve", action="store_true", help="Curve on both sides")
    p.add_argument("--publisher-module", default=None)
    args = p.parse_args()

    mpx = mp.get_context("spawn")
    ports = (free_port(), free_port())
    keydir = None
    if args.curve:
        keydir = tempfile.mkdtemp(prefix="kv-curve-")
        make_keys(Path(keydir))
    ready, flood_on, done, stop = mpx.Event(), mpx.Event(), mpx.Event(), mpx.Event()
    out = mpx.Queue()
    eng = mpx.Process(target=engine, args=(args, ports, keydir, ready, flood_on, stop, done, out))
    eng.start()
    if not ready.wait(300):
        raise SystemExit("engine stand-in did not fill its buffer")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if keydir:
        from epdserve.connectors.kv_events import CurveClientKeys

        CurveClientKeys.load(keydir).apply(sub)
    sub.connect(f"tcp://127.0.0.1:{ports[0]}")
    sub.poll(5000)  # connected once live batches flow
    received: list[tuple[float, float]] = []  # (publish time, delay)

    def receive_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if sub.poll(50):
                _, _, payload = sub.recv_multipart()
                ts = msgspec.msgpack.decode(payload)[0]
                received.append((ts, time.time() - ts))

    receive_for(args.phase_s)
    flood_start = time.time()
    flood_on.set()
    flood = mpx.Process(target=flooder, args=(args, ports[1], keydir, stop, out))
    flood.start()
    receive_for(args.phase_s)
    flood_end = time.time()
    stop.set()
    receive_for(args.drain_s)  # batches of the flood phase may still be on their way
    done.set()
    results = [out.get(timeout=60), out.get(timeout=60)]
    eng.join(30)
    flood.join(30)
    sub.close(0)
    ctx.term()
    delays = {
        "quiet": [d for ts, d in received if ts < flood_start],
        "flood": [d for ts, d in received if flood_start <= ts < flood_end],
    }
    eng_out = next(r for r in results if "late" in r)
    flood_out = next(r for r in results if "replay_batches_received" in r)
    report = {
        "bench": "kv_events_replay",
        "publisher": args.publisher_module or "epdserve",
        "curve": args.curve,
        "dealers": args.dealers,
        "dealers_ask_again": not args.once,
        "buffer_batches": args.buffer,
        "blocks_per_batch": args.blocks,
        "step_interval_ms": args.interval_ms,
        "step_work_ms": args.step_work_ms,
        "live_delay_quiet": summary(delays["quiet"]),
        "live_delay_flood": summary(delays["flood"]),
        "step_lateness_quiet": summary(eng_out["late"]["quiet"]),
        "step_lateness_flood": summary(eng_out["late"]["flood"]),
        "live_batches_expected_per_phase": int(args.phase_s * 1000 / args.interval_ms),
        "replay_batches_per_s": round(flood_out["replay_batches_received"] / args.phase_s),
        **flood_out,
        "publisher_stats": eng_out["stats"],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
