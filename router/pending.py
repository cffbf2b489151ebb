"""Speculative prefix entries: blocks a pod is about to cache because we just sent it
a request. They bridge the gap until the pod's BlockStored events arrive, so a burst of
requests sharing a new prefix lands on one pod instead of being spread by load.

The router adds them for the first-ranked pod as it ranks (under the same lock, so requests
routed at the same instant see each other), the proxy when it sends a request (not when the
answer comes: a pod's answer, or a stream's first token, comes after the prefill, which is the
very gap to bridge); the proxy withdraws them from a pod that refuses it, and adds them again at
the answer, so ``ttl`` runs from there.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PendingPrefixes:
    """key -> {pod: expiry}, bounded (oldest first out) and expiring after ``ttl`` s."""

    def __init__(self, ttl: float = 2.0, capacity: int = 200_000) -> None:
        self.ttl, self.capacity = ttl, capacity
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, pod: str, keys: Sequence[int], now: float | None = None) -> None:
        """Remember that ``pod`` will soon hold ``keys``."""
        if self.ttl <= 0 or not keys:
            return
        expiry = (now or time.monotonic()) + self.ttl
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    self._entries[key] = {pod: expiry}
                else:
                    entry[pod] = expiry
                    self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def match(
        self, keys: Sequence[int], pods: Iterable[str], now: float | None = None
    ) -> dict[str, int]:
        """Per pod, the consecutive run of ``keys`` it is expected to hold."""
        now = now or time.monotonic()
        result = {pod: 0 for pod in pods}
        active = set(result)
        with self._lock:
            for depth, key in enumerate(keys, start=1):
                entry = self._entries.get(key)
                if entry is None:
                    break
                active = {p for p in active if entry.get(p, 0.0) > now}
                if not active:
                    break
                for pod in active:
                    result[pod] = depth
        return result

    def discard(self, pod: str, keys: Sequence[int]) -> None:
        """Withdraw ``pod``'s expectation of ``keys`` (it refused the request)."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.pop(pod, None)
                    if not entry:
                        del self._entries[key]

    def remove_pod(self, pod: str) -> None:
        """Forget every expectation about ``pod``."""
        with self._lock:
            for key in list(self._entries):
                entry = self._entries[key]
                entry.pop(pod, None)
                if not entry:
                    del self._entries[key]
