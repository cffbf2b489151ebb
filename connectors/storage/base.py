"""The storage seam: a batched key -> bytes store that never raises on backend faults."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields


class Counters:
    """Thread-safe monotonic integer counters (the dataclass fields of a subclass)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}


class ReasonCounts:
    """Thread-safe counts by reason (e.g. stored values refused, by why)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reasons: Iterable[str]) -> None:
        with self._lock:
            for reason in reasons:
                self._counts[reason] = self._counts.get(reason, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass
class StoreStats(Counters):
    """Counters of one store (the engine exports them as Prometheus counters)."""

    puts: int = 0  # values stored
    put_failures: int = 0  # values not stored: backend down/slow, read-only, full, too large
    gets: int = 0  # keys looked up by get_many
    hits: int = 0  # keys that returned a value
    get_failures: int = 0  # keys not read because of a backend fault, skipped ones included
    rejected: int = 0  # values read back but refused (over the size limit, wrong type): deleted
    skipped: int = 0  # keys not even tried because the backend was marked down
    reconnects: int = 0  # recoveries after the backend had been marked down
    evictions: int = 0  # values this store evicted itself (size cap)


class BlockStore(ABC):
    """A shared key -> bytes store of whole values (KV blocks, encoder outputs).

    Every method is batched, thread-safe and never raises because of the backend (down,
    slow, full, read-only, garbage): it reports misses/failures and counts them in
    ``stats``. Only programming errors (wrong argument types) raise.
    """

    stats: StoreStats

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Store each value under its key, replacing any previous value atomically (a reader
        sees the old or the new value whole). Mutates the backend and ``stats``; returns, per
        item, whether it was stored."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each key, ``None`` for a miss or a fault. A value the store refuses
        (over its size limit, not a plain value) is a miss too, and is deleted so it is not
        read again. Mutates ``stats`` (and may refresh the entries' recency for LRU eviction)."""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a value now (``False`` on a fault); mutates nothing but
        ``stats``. A later get may still miss (eviction, TTL)."""

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove the keys; mutates the backend. Returns how many existed (0 on a fault)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections/handles; the store must not be used afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CircuitBreaker:
    """ "Down until T" state: after a fault, calls are refused for a delay that doubles on each
    consecutive fault (up to ``max_s``), so a dead backend is not hammered on every call."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic):
        self.initial_s, self.max_s, self.clock = initial_s, max_s, clock
        self._failures = 0  # consecutive faults since the last success
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def is_down(self) -> bool:
        """Whether a fault has been seen and no success since (a probe may still be allowed)."""
        return self._failures > 0

    def allow(self) -> bool:
        """Whether a call may go to the backend now."""
        return self.clock() >= self._down_until

    def record_failure(self) -> None:
        with self._lock:
            delay = min(self.max_s, self.initial_s * 2 ** min(self._failures, 32))
            self._failures += 1
            self._down_until = self.clock() + delay

    def record_success(self) -> bool:
        """Close the breaker; returns whether it had been open (i.e. this is a reconnect)."""
        with self._lock:
            was_down, self._failures, self._down_until = self._failures > 0, 0, 0.0
            return was_down
