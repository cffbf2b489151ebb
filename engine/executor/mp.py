"""``mp``: a worker process per rank (the default above tensor-parallel size 1).

Each call goes to every rank once, through one shared-memory ring (``shm_ring``: msgspec
bytes; a step's pixels are written once, whatever the number of ranks), and every rank
replies through a ring of its own. Failures, within bounded time (DESIGN.md §10):

- a rank that exits is seen within ``ALIVE_EVERY`` (the wait checks its process);
- a rank that does not reply within ``step_timeout_s()`` is hung (its collectives time out
  after the same bound, so no peer waits forever);
- a rank that raises: when every rank replied and all entered the same number of collectives,
  the group is in step and the error is the step's (``RankFailure``: the core's step guard
  contains it); otherwise, or when a peer has not replied ``GRACE_S`` after the error, the
  group is out of step.

The last three raise ``WorkerFailure``: the core fails its requests and exits, its workers
die with it (parent-death signal), and the pod restarts.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import weakref

import msgspec

from epdserve.engine.config import EngineConfig, encode_config
from epdserve.engine.cpus import usable_cpus
from epdserve.engine.executor.base import Executor, check_rank_method
from epdserve.engine.executor.rank_messages import (
    SIGNATURES,
    RankCall,
    RankReply,
    RankStart,
    WorkerFailure,
    rebuild,
)
from epdserve.engine.executor.shm_ring import SLEEP_BUSY, SLEEP_MAX, RingHandle, ShmRing
from epdserve.engine.worker.parallel import step_timeout_s

log = logging.getLogger("epdserve.executor")

CALL_CHUNK, CALL_CHUNKS = 1 << 20, 8  # a step's message is KBs; pixels go out in fragments
START_TIMEOUT_S = 60.0  # a process to start and map its rings
LOAD_TIMEOUT_S = 1800.0  # loading a large checkpoint from a slow volume
GRACE_S = 5.0  # after a rank's error, for its peers to reply
POLL_S = 0.02  # a wait's slice while several ranks are pending
_encode = msgspec.msgpack.Encoder()
_decode_reply = msgspec.msgpack.Decoder(RankReply)


def rank_cpus(size: int) -> list[list[int]]:
    """Disjoint cores for each rank, from the CPUs this pod may use; ranks share cores (with
    a warning) only when there are fewer CPUs than ranks."""
    cpus = sorted(os.sched_getaffinity(0))[: usable_cpus()]
    if len(cpus) < size:
        log.warning("%d ranks share %d CPUs: each rank gets one, some twice", size, len(cpus))
        return [[cpus[r % len(cpus)]] for r in range(size)]
    per = len(cpus) // size
    return [cpus[r * per : (r + 1) * per] for r in range(size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.size = config.tensor_parallel_size
        self._closed = False
        self._step_s = 0.0  # how long the last call took: the reply waits poll in proportion
        self.ranks = _Ranks(ShmRing.create(self.size, CALL_CHUNK, CALL_CHUNKS))
        self.calls, self.procs, self.replies = (
            self.ranks.calls,
            self.ranks.procs,
            self.ranks.replies,
        )
        self._finalizer = weakref.finalize(self, self.ranks.stop)
        try:
            self._start(config)
            self.collective_rpc("load_model", timeout=LOAD_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        on_cpu = not config.device.startswith("cuda")
        cpus = rank_cpus(self.size) if on_cpu else [[] for _ in range(self.size)]
        pipes = []
        for rank in range(self.size):
            read_fd, write_fd = os.pipe()
            env = dict(os.environ)
            if cpus[rank]:
                env["OMP_NUM_THREADS"] = str(len(cpus[rank]))
            proc = subprocess.Popen(
                [sys.executable, "-m", "epdserve.engine.executor.worker_proc"]
                + ["--handshake-fd", str(write_fd)],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                env=env,
            )
            os.close(write_fd)
            start = RankStart(
                encode_config(config), rank, init_method, self.calls.handle, cpus[rank], os.getpid()
            )
            proc.stdin.write(_encode.encode(start))
            proc.stdin.close()
            self.procs.append(proc)
            pipes.append(read_fd)
        for rank, fd in enumerate(pipes):
            with os.fdopen(fd, "rb") as pipe:
                data = pipe.read()  # EOF when the rank wrote its handle, or died
            if not data:
                code = self.procs[rank].wait(timeout=START_TIMEOUT_S)
                raise WorkerFailure(f"rank {rank}: exited with status {code} while starting")
            handle = msgspec.msgpack.decode(data, type=RingHandle)
            alive = self._alive(rank)
            ring = ShmRing.attach(handle, 0, alive=alive)
            self.replies.append(ring)
        log.info(
            "%d worker processes (tensor parallel), cores %s",
            self.size,
            cpus if on_cpu else "(gpu)",
        )

    def _alive(self, rank: int):
        procs = self.procs  # not self: the finalizer must not keep the executor alive
        return lambda: procs[rank].poll() is None

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None):
        return self._receive(method, self._send(method, args, timeout))

    def _send(self, method: str, args: tuple, timeout: float | None = None) -> float:
        """Write one call for every rank; the deadline of its replies."""
        check_rank_method(method)
        if self._closed:
            raise WorkerFailure(f"{method}: the workers are shut down")
        deadline = time.monotonic() + (timeout or step_timeout_s())
        call = RankCall(method, msgspec.Raw(_encode.encode(args)))
        try:
            self.calls.write(_encode.encode(call), timeout=timeout or step_timeout_s())
        except (TimeoutError, ConnectionError) as exc:
            raise WorkerFailure(f"{method}: the ranks stopped reading calls ({exc})") from None
        return deadline

    def _receive(self, method: str, deadline: float) -> list:
        """Every rank's result of the call ``_send`` wrote; raises what a rank raised."""
        try:
            replies = self._gather(method, deadline)
        except WorkerFailure:
            self.ranks.failed = True
            raise
        errors = [(r.rank, r.error) for r in replies if r.error is not None]
        if errors:
            if len({r.collectives for r in replies}) > 1:
                self.ranks.failed = True
                raise WorkerFailure(
                    f"{method}: rank {errors[0][0]} raised {errors[0][1].kind}: "
                    f"{errors[0][1].message}; the ranks left the step out of step"
                )
            rank, err = next(((r, e) for r, e in errors if r == self.output_rank), errors[0])
            log.debug("rank %d's %s raised:\n%s", rank, method, err.trace)
            raise rebuild(rank, err)
        result_type = SIGNATURES[method][1]
        return [msgspec.msgpack.decode(r.result, type=result_type) for r in replies]

    def _gather(self, method: str, deadline: float) -> list[RankReply]:
        """Every rank's reply; ``WorkerFailure`` for a rank that died, hung or fell behind a
        peer's error."""
        got: dict[int, RankReply] = {}
        # poll a short step closely, a long one less often: a waiting core's wake-ups take
        # time from the ranks on its cores (0.5B: 1 ms here beat 0.1 ms, the tiny preset not)
        started = time.monotonic()
        for ring in self.replies:
            ring.max_sleep = min(SLEEP_MAX, max(SLEEP_BUSY / 2, self._step_s / 50))
        while len(got) < self.size:
            now = time.monotonic()
            if now > deadline:
                late = sorted(set(range(self.size)) - set(got))
                raised = [f"rank {r} raised {e.error.kind}" for r, e in got.items() if e.error]
                why = f" after {', '.join(raised)}" if raised else ""
                raise WorkerFailure(
                    f"{method}: rank(s) {late} did not reply in time{why}: hung, or waiting "
                    "in a collective for a peer that is"
                )
            for rank in range(self.size):
                if rank in got:
                    continue
                slice_s = min(POLL_S, deadline - now) if self.size - len(got) > 1 else None
                wait = max(0.0, slice_s if slice_s is not None else deadline - now)
                try:
                    got[rank] = _decode_reply.decode(self.replies[rank].read(timeout=wait))
                except (TimeoutError, ConnectionError):
                    # a slice may end before the ring's own check: look at the process too
                    code = self.procs[rank].poll()
                    if code is None:
                        continue
                    raise WorkerFailure(f"{method}: rank {rank} exited (status {code})") from None
                if got[rank].error is not None:
                    deadline = min(deadline, time.monotonic() + GRACE_S)
        self._step_s = time.monotonic() - started
        return [got[r] for r in range(self.size)]

    def check_health(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self.ranks.failed = True
                raise WorkerFailure(f"rank {rank} exited (status {proc.returncode}) while idle")

    def execute_model(self, sched):
        return self.collective_rpc("execute_model", (sched,))[self.output_rank]

    def execute_model_async(self, sched):
        """The call goes out now; the replies are read by ``result()`` (the ranks run the
        step meanwhile)."""
        deadline = self._send("execute_model", (sched,))
        receive = self._receive
        return _LateStep(lambda: receive("execute_model", deadline)[self.output_rank])

    def shutdown(self) -> None:
        self._closed = True
        self._finalizer()


class _Ranks:
    """The processes and rings of the ranks, stopped by ``stop`` (also when the executor is
    collected or the interpreter exits: ``LLM`` users never call shutdown)."""

    def __init__(self, calls: ShmRing):
        self.calls: ShmRing | None = calls
        self.failed = False  # a rank died, hung or fell out of step
        self.procs: list[subprocess.Popen] = []
        self.replies: list[ShmRing] = []

    def stop(self) -> None:
        if self.calls is None:
            return
        grace = 0.0  # a group with a dead or failed rank is killed at once: its peers may
        if not self.failed and self.replies and all(p.poll() is None for p in self.procs):
            bye = RankCall("shutdown", msgspec.Raw(_encode.encode(())))  # wait in a collective
            try:  # each rank closes its stores and its ring, then exits
                self.calls.write(_encode.encode(bye), timeout=GRACE_S)
                grace = GRACE_S
            except (TimeoutError, ConnectionError) as exc:
                log.warning("workers did not take the shutdown: %s", exc)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ring in [*self.replies, self.calls]:
            ring.close()
        self.calls = None


class _LateStep:
    """A step whose call went out; ``result()`` reads its replies once."""

    cpu_seconds = 0.0  # the model runs in the ranks' processes, not this one

    def __init__(self, read):
        self._read = read

    def result(self):
        return self._read()
