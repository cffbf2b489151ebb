"""Detects pods that root their block-hash chains differently from the rest of the pool.

Engines name a prompt's first block ``H((NONE_HASH, tokens, extra_keys))`` with
``NONE_HASH = H(hash_seed)``, so two pods that store the same first block (same tokens,
no parent, the same LoRA and salt) under different engine hashes run with a different
``--hash-seed`` or hash algorithm. Routing does not care (the router's own keys ignore
engine hashes), but such pods can never find each other's blocks in the shared store: a
P/D decode pod cannot load what its prefill pod saved. Each disagreeing block counts for
both pods in ``epdserve_router:hash_seed_mismatches{pod}`` (the odd pod out counts most),
and each pair of pods is named once in a WARNING.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable

from epdserve.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class RootHashCheck:
    """First blocks seen per router key, with each pod's engine hash (bounded, LRU).

    One instance is shared by every role's router of a pool: a prefill and a decode pod
    must agree most of all."""

    def __init__(self, metrics: RouterMetrics, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.metrics, self.capacity = metrics, capacity
        self._roots: OrderedDict[int, dict[str, int]] = OrderedDict()  # key -> pod -> hash
        self._warned: set[frozenset[str]] = set()
        self._lock = threading.Lock()

    def observe(self, pod: str, roots: Iterable[tuple[int, int]]) -> None:
        """``pod`` stored first blocks ``(router key, engine hash)``: compare with the others."""
        pairs: list[tuple[str, int, int]] = []
        with self._lock:
            for key, engine_hash in roots:
                entry = self._roots.setdefault(key, {})
                self._roots.move_to_end(key)
                for other, theirs in entry.items():
                    if other != pod and theirs != engine_hash:
                        pairs.append((other, theirs, engine_hash))
                entry[pod] = engine_hash
            while len(self._roots) > self.capacity:
                self._roots.popitem(last=False)
            fresh = [p for p in pairs if self._first_warning(pod, p[0])]
        for other, _, _ in pairs:
            self.metrics.hash_seed_mismatches.labels(pod).inc()
            self.metrics.hash_seed_mismatches.labels(other).inc()
        for other, theirs, ours in fresh:
            log.warning(
                "pods %s and %s name the same first KV block differently (engine hashes "
                "%#x and %#x): their --hash-seed or hash algorithm differ, so neither finds "
                "the other's blocks in the shared store (P/D transfer between them misses); "
                "routing is unaffected",
                other,
                pod,
                theirs,
                ours,
            )

    def _first_warning(self, pod: str, other: str) -> bool:
        pair = frozenset((pod, other))
        if pair in self._warned:
            return False
        self._warned.add(pair)
        return True

    def forget_pod(self, pod: str) -> None:
        """The pod left the pool: drop its hashes (a successor may use a new seed)."""
        with self._lock:
            for key in list(self._roots):
                entry = self._roots[key]
                entry.pop(pod, None)
                if not entry:
                    del self._roots[key]
            self._warned = {pair for pair in self._warned if pod not in pair}
