"""The scheduler's waiting queue under each scheduling policy (``--scheduling-policy``).

``fcfs``: arrival order; a preempted request goes back to the head. ``priority``: the
smallest ``(priority, arrival_time)`` first (lower priority values are served earlier, ties
by arrival), and a preempted or skipped request goes back by that key, not to the head. Both
queues take the same deque-like calls from the scheduler, so the scheduling loop is one;
``put_first`` is the one place either queue puts requests ahead of every other (a solo run
of the step guard, prefixes whose load just finished and hold their blocks).

When blocks run out for a running request, the victim is the last running request under
``fcfs`` and the running request with the largest ``(priority, arrival_time)`` under
``priority`` (``victim_index``), as vLLM v1 chooses.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from epdserve.engine.core.request import Request


class FCFSQueue(deque):
    """Arrival order: a ``deque`` of requests (today's queue) with ``put_first``."""

    def put_first(self, requests: Iterable[Request]) -> None:
        """Place ``requests`` at the head, in their order."""
        self.extendleft(reversed(list(requests)))


class PriorityQueue:
    """Smallest ``(priority, arrival_time)`` first; ``put_first`` requests before those.

    The deque calls the scheduler makes keep their meaning where it has one here:
    ``append``/``appendleft``/``extendleft`` all insert by key (a priority queue has no
    head to push onto), ``popleft`` and ``[0]`` take the first, ``remove`` takes any.
    """

    def __init__(self) -> None:
        self._first: deque[Request] = deque()  # put_first, ahead of the heap, in order
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()  # equal keys: insertion order, never a Request compare

    def append(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._seq), request)
        )

    appendleft = append

    def extendleft(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def put_first(self, requests: Iterable[Request]) -> None:
        """Place ``requests`` ahead of every keyed request, in their order."""
        self._first.extendleft(reversed(list(requests)))

    def popleft(self) -> Request:
        if self._first:
            return self._first.popleft()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[3]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("a priority queue reads only its first request")
        if self._first:
            return self._first[0]
        if not self._heap:
            raise IndexError("an empty queue has no first request")
        return self._heap[0][3]

    def remove(self, request: Request) -> None:
        if any(r is request for r in self._first):
            self._first.remove(request)
            return
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                del self._heap[i]
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{request!r} is not waiting")

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in the order they would be popped."""
        yield from self._first
        yield from (entry[3] for entry in sorted(self._heap))

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self._first) or any(e[3] is request for e in self._heap)

    def __len__(self) -> int:
        return len(self._first) + len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._first or self._heap)


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy: must be fcfs or priority, got {policy!r}")


def victim_index(running: list[Request], policy: str) -> int:
    """Which running request to preempt when blocks run out: the last one admitted
    (``fcfs``), or the one with the largest ``(priority, arrival_time)`` (``priority``)."""
    if policy == "fcfs":
        return len(running) - 1
    return max(range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time))
