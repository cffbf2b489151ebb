"""What the harness saw happen, in order: probe verdicts, container exits, Service endpoint
changes, connections the service proxy could not forward. A failing test prints the tail
(cluster.describe), so a failure seen only elsewhere (CI) says which of these came first."""

from __future__ import annotations

import collections
import threading
import time


def stamp() -> str:
    """The UTC time of day to the millisecond, as every event line starts."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}"


class EventLog:
    """A bounded, thread-safe list of timestamped lines."""

    def __init__(self, size: int = 2000):
        self._lines: collections.deque[str] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, source: str, text: str) -> None:
        line = f"{stamp()} {source}: {text}"
        with self._lock:
            self._lines.append(line)

    def tail(self, n: int) -> list[str]:
        with self._lock:
            return list(self._lines)[-n:]

    def matching(self, needle: str) -> list[str]:
        with self._lock:
            return [line for line in self._lines if needle in line]


EVENTS = EventLog()  # one cluster per test process
