"""Grammar compiles queued fairly: one queue per client, taken in turn, in lanes by cost.

A compile cannot be interrupted once xgrammar runs it, so what is bounded is what may start:
the API refuses a spec over ``MAX_COMPILE_COST`` (schema_cost.py), a compile whose requests
have all gone (aborted, timed out) is dropped before it starts, and a client with many
compiles queued takes one turn per round like any other (``FairQueue``). A cheap spec (a ``choice``, a short
regex) goes to its own lane, so it never waits behind a large schema.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class CompileJob:
    """One spec to compile, for the requests in ``waiters`` (shared by equal specs)."""

    __slots__ = ("params", "client", "future", "waiters")

    def __init__(self, params: Any, client: str, waiter: Any):
        self.params, self.client = params, client
        self.future: Future = Future()
        self.waiters = [waiter]  # engine requests (``is_finished``)

    def wanted(self) -> bool:
        """Whether a request still waits for it."""
        return any(not r.is_finished for r in self.waiters)


class FairQueue:
    """Start-time fair queueing over clients, one unit per job: a job's tag is when its
    client's turn comes (after that client's previous job, and not before the job now being
    served), and the lowest tag goes first. A client that queues many jobs takes one turn per
    round; one that comes later goes before the others' second jobs. Not thread-safe
    (``CompileLane`` locks)."""

    MAX_CLIENTS = 4096  # client tags kept; past that, those whose turn has passed are dropped

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, CompileJob]] = []
        self._next_turn: dict[str, int] = {}  # per client: the tag of its next job
        self._now = 0  # the tag of the job taken last
        self._seq = 0  # arrival order among equal tags

    def __len__(self) -> int:
        return len(self._heap)

    def put(self, job: CompileJob) -> None:
        tag = max(self._now, self._next_turn.get(job.client, 0))
        self._next_turn[job.client] = tag + 1
        self._seq += 1
        heapq.heappush(self._heap, (tag, self._seq, job))
        if len(self._next_turn) > self.MAX_CLIENTS:
            self._next_turn = {c: t for c, t in self._next_turn.items() if t > self._now}

    def take(self) -> CompileJob | None:
        """The job whose turn it is, or None when empty."""
        if not self._heap:
            return None
        self._now, _, job = heapq.heappop(self._heap)
        return job


class CompileLane:
    """A thread that compiles the jobs of its ``FairQueue``; those nobody waits for any
    more are dropped (their future cancelled) instead. ``lock`` is shared with the manager,
    which adds waiters to queued jobs under it."""

    def __init__(self, name: str, compile_fn: Callable[[Any], Any], lock: threading.Lock):
        self.name, self._compile = name, compile_fn
        self.lock = lock
        self._ready = threading.Condition(lock)
        self._queue = FairQueue()
        self._closed = False
        self.compiled = 0
        self.dropped = 0  # compiles nobody waited for when their turn came
        self._thread = threading.Thread(target=self._run, name=f"grammar-{name}", daemon=True)
        self._thread.start()

    def put(self, job: CompileJob) -> None:
        """Queue ``job`` (call with ``lock`` held)."""
        self._queue.put(job)
        self._ready.notify()

    def queued(self) -> int:
        with self.lock:
            return len(self._queue)

    def _next(self) -> CompileJob | None:
        with self.lock:
            while True:
                while not self._closed and not len(self._queue):
                    self._ready.wait()
                if self._closed:
                    return None
                job = self._queue.take()
                if job.wanted():
                    job.future.set_running_or_notify_cancel()
                    return job
                job.future.cancel()
                self.dropped += 1

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                job.future.set_result(self._compile(job.params))
            except BaseException as exc:  # the waiting requests fail with it (a 400)
                job.future.set_exception(exc)
            self.compiled += 1

    def close(self) -> None:
        """Stop after the running compile; queued ones are cancelled."""
        with self.lock:
            self._closed = True
            while (job := self._queue.take()) is not None:
                job.future.cancel()
            self._ready.notify_all()
