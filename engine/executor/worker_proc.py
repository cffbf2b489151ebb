"""A worker process of the ``mp`` executor: ``python -m epdserve.engine.executor.worker_proc
--handshake-fd FD``, its ``RankStart`` msgpack-encoded on stdin (never the command line: the
config may hold a store password).

It pins itself to its cores, creates the ring it replies through and writes that ring's handle
to the handshake pipe, then serves calls from the core's broadcast ring until ``shutdown``:
each call runs ``Worker.<method>`` and replies with its result or its error. It exits when
the core is gone (Linux's parent-death signal, and a check while it waits).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time

import msgspec

from epdserve.common.logs import setup_logging
from epdserve.engine.config import decode_config
from epdserve.engine.executor.rank_messages import (
    SIGNATURES,
    RankCall,
    RankReply,
    RankStart,
    error_of,
)
from epdserve.engine.executor.shm_ring import SLEEP_BUSY, SLEEP_MAX, ShmRing

log = logging.getLogger("epdserve.worker")

BUSY_FOR_S = 0.05  # a call this recent means the engine is stepping
REPLY_CHUNK = 4 << 20  # a step's output: token ids, logprobs (pixels never come back)
_encode = msgspec.msgpack.Encoder()
_decode_call = msgspec.msgpack.Decoder(RankCall)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # PR_SET_PDEATHSIG: killed with the core
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def serve(start: RankStart, handshake_fd: int) -> None:
    import torch

    if start.cpus:
        os.sched_setaffinity(0, start.cpus)
        torch.set_num_threads(len(start.cpus))
    from epdserve.engine.worker.worker import Worker

    def core_alive() -> bool:
        return os.getppid() == start.core_pid

    replies = ShmRing.create(1, chunk_bytes=REPLY_CHUNK, n_chunks=4, alive=core_alive)
    calls = ShmRing.attach(start.calls, start.rank, alive=core_alive)
    with os.fdopen(handshake_fd, "wb") as pipe:
        pipe.write(_encode.encode(replies.handle))
    config = decode_config(start.config)
    worker = Worker(config, start.rank, start.init_method)
    try:
        last = waited = time.monotonic()
        while True:  # between steps of a busy engine poll closely (in proportion to the last
            # gap: wake-ups take time from the core on the same cores), when idle sleep longer
            idle = time.monotonic() - last >= BUSY_FOR_S
            calls.max_sleep = SLEEP_MAX if idle else min(SLEEP_MAX, max(SLEEP_BUSY / 2, waited / 4))
            asked = time.monotonic()
            call = _decode_call.decode(calls.read(timeout=None))
            last = time.monotonic()
            waited = last - asked
            reply = RankReply(start.rank)
            try:
                args = msgspec.msgpack.decode(call.args, type=SIGNATURES[call.method][0])
                result = getattr(worker, call.method)(*args)
                if call.method == "execute_model" and not worker.tp.is_output:
                    result = None  # the core reads the output rank's
                reply.result = msgspec.Raw(_encode.encode(result))
            except Exception as exc:  # the core decides what a rank's error means
                log.debug("rank %d: %s raised", start.rank, call.method, exc_info=True)
                reply.error = error_of(exc)
            reply.collectives = worker.tp.num_collectives
            replies.write(_encode.encode(reply), timeout=None)
            if call.method == "shutdown":
                break
    finally:
        calls.close()
        replies.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epdserve-worker", description="RankStart on stdin")
    parser.add_argument("--handshake-fd", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    setup_logging()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    start = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=RankStart)
    serve(start, args.handshake_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
