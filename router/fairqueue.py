"""Weighted fair admission of requests to saturated pods: start-time fair queueing.

The router admits at most ``capacity()`` requests at once (``--max-inflight-per-pod`` x the
pods it can route to). Past that, requests wait in per-tenant queues. Each gets a virtual
start tag ``S = max(V, F_tenant)`` and moves its tenant's finish tag to ``F = S + 1/weight``;
a freed slot goes to the waiting request with the smallest start tag (arrival order breaks
ties) and ``V`` becomes that tag. So backlogged tenants share slots in proportion to their
weights, a tenant that was idle starts level with ``V`` (no credit for idle time, no debt
for past use), and no slot stays free while anyone waits (work-conserving).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "epdserve_router:"
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REPUMP_S = 0.5  # waiters re-check capacity this often: pods come back without a release


class QueueFull(Exception):
    """The tenant already has its maximum of waiting requests (a 429)."""


class QueueTimeout(Exception):
    """The request waited ``timeout`` seconds without a slot (a 503)."""


class TenantQueueMetrics:
    """Per-tenant admission metrics, on the router's registry (tenant labels are bounded
    by the caller, see ``TenantLabels``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_seconds = Histogram(
            P + "tenant_queue_seconds",
            "Time a request waited in the router's fair queue before it was sent on",
            ["tenant"],
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            P + "tenant_queue_depth",
            "Requests waiting in the fair queue",
            ["tenant"],
            registry=registry,
        )
        self.admitted = Counter(
            P + "tenant_requests_admitted",
            "Generation requests sent on to the pods, by tenant",
            ["tenant"],
            registry=registry,
        )
        self.rejected = Counter(
            P + "tenant_requests_rejected",
            "Generation requests refused or abandoned while queued, by tenant and reason "
            "(queue_full: 429, queue_timeout: 503, disconnected: the client left)",
            ["tenant", "reason"],
            registry=registry,
        )
        self.keys_reload_errors = Counter(
            P + "tenant_keys_reload_errors",
            "Changed tenant-keys files that did not parse (the last good keys stay)",
            registry=registry,
        )
        self.active = Gauge(
            P + "fair_queue_active", "Requests holding a fair-queue slot", registry=registry
        )
        self.capacity = Gauge(
            P + "fair_queue_capacity", "Slots the fair queue may hand out now", registry=registry
        )


@dataclass(eq=False)
class _Waiter:
    tenant: str
    start: float  # virtual start tag
    future: asyncio.Future = field(repr=False)


class FairQueue:
    """Slots handed out by weighted fairness; ``acquire`` waits for one, ``release`` frees it.

    ``reserve()`` extra slots go only to a tenant holding less than its weighted share of
    ``capacity()`` (shares among the tenants holding or waiting for slots): a light tenant
    then starts at once instead of waiting for a heavy tenant's request to finish, which the
    pods absorb if their batch has that much room. Single event loop, no locks."""

    def __init__(
        self,
        capacity: Callable[[], int],
        max_waiting: int = 256,
        timeout: float = 30.0,
        on_depth: Callable[[str, int], None] | None = None,
        reserve: Callable[[], int] = lambda: 0,
    ) -> None:
        self.capacity, self.reserve = capacity, reserve  # slots allowed now (read each time)
        self.max_waiting, self.timeout = max_waiting, timeout
        self.on_depth = on_depth or (lambda tenant, delta: None)  # a tenant's queue +1/-1
        self.active = 0  # slots held
        self.admissions = 0  # admission ordinal of the last slot handed out
        self._vtime = 0.0
        self._finish: dict[str, float] = {}
        self._depth: dict[str, int] = {}
        self._held: dict[str, int] = {}  # slots held per tenant
        self._weight: dict[str, float] = {}  # tenants holding or waiting: their weight
        self._heap: list[tuple[float, int, _Waiter]] = []
        self._queues: dict[str, deque[_Waiter]] = {}  # the same waiters, per tenant
        self._order = itertools.count()
        self._dead = 0  # abandoned waiters still in the heap

    def depth(self, tenant: str | None = None) -> int:
        """Requests waiting (for one tenant, or in all)."""
        if tenant is None:
            return sum(self._depth.values())
        return self._depth.get(tenant, 0)

    def held(self, tenant: str) -> int:
        """Slots ``tenant`` holds."""
        return self._held.get(tenant, 0)

    def poke(self) -> None:
        """Capacity may have grown: hand out free slots now rather than at the next tick."""
        self._pump()

    def check_integrity(self) -> None:
        """Assert the bookkeeping agrees with itself (tests call this after every step)."""
        live = [w for _, _, w in self._heap if not w.future.done()]
        assert self.active == sum(self._held.values()), (self.active, self._held)
        assert len(live) == self.depth(), (len(live), self._depth)
        for tenant, depth in self._depth.items():
            assert sum(not w.future.done() for w in self._queues[tenant]) == depth, tenant
        assert set(self._weight) >= set(self._depth) | {t for t, n in self._held.items() if n}
        if live:  # work-conserving: nobody waits while a normal slot is free (after a pump)
            assert self.active >= self.capacity(), (self.active, self.capacity())

    async def acquire(self, tenant: str, weight: float = 1.0) -> int:
        """Wait for a slot; returns its admission ordinal. Raises QueueFull, QueueTimeout;
        a cancelled caller leaves the queue (and gives back a slot it was just handed)."""
        if self._depth.get(tenant, 0) >= self.max_waiting:
            raise QueueFull(f"tenant {tenant!r} has {self.max_waiting} requests waiting")
        self._weight[tenant] = weight
        waiter = _Waiter(
            tenant, self._tag(tenant, weight), asyncio.get_running_loop().create_future()
        )
        heapq.heappush(self._heap, (waiter.start, next(self._order), waiter))
        self._queues.setdefault(tenant, deque()).append(waiter)
        self._add_depth(tenant, +1)
        self._pump()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while not waiter.future.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise QueueTimeout(f"no capacity within {self.timeout:g} s")
                await asyncio.wait({waiter.future}, timeout=min(left, REPUMP_S))
                self._pump()
            return waiter.future.result()
        except BaseException:
            self._abandon(waiter)
            raise

    def release(self, tenant: str) -> None:
        """A request of ``tenant`` holding a slot finished: hand the slot on."""
        assert self.active > 0 and self._held.get(tenant, 0) > 0, f"no slot of {tenant!r}"
        self.active -= 1
        self._held[tenant] -= 1
        self._forget(tenant)
        self._pump()

    def _tag(self, tenant: str, weight: float) -> float:
        if len(self._finish) > 4 * len(self._depth) + 64:
            # forget tenants with nothing waiting: their next request starts at V (a head
            # start of at most one request each), and header-named tenants cannot grow this
            self._finish = {t: f for t, f in self._finish.items() if t in self._depth}
        start = max(self._vtime, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + 1.0 / weight
        return start

    def _under_share(self, tenant: str, capacity: int) -> bool:
        share = capacity * self._weight[tenant] / sum(self._weight.values())
        return self._held.get(tenant, 0) < share

    def _pump(self) -> None:
        """Hand free slots to the waiters with the smallest start tags; reserve slots to the
        earliest waiter of a tenant under its share."""
        capacity = self.capacity()
        while self._heap and self.active < capacity:
            start, _, waiter = heapq.heappop(self._heap)
            if waiter.future.done():  # abandoned, or admitted from the reserve
                self._dead -= 1
                continue
            self._admit(waiter)
        ceiling = capacity + self.reserve()
        while self._depth and self.active < ceiling:
            heads = [self._head(t) for t in self._depth if self._under_share(t, capacity)]
            if not heads:
                return
            self._admit(min(heads, key=lambda w: w.start))
            self._dead += 1  # its heap entry stays until popped

    def _head(self, tenant: str) -> _Waiter:
        queue = self._queues[tenant]
        while queue[0].future.done():
            queue.popleft()
        return queue[0]

    def _admit(self, waiter: _Waiter) -> None:
        self._vtime = max(self._vtime, waiter.start)
        self._add_depth(waiter.tenant, -1)
        self.active += 1
        self._held[waiter.tenant] = self._held.get(waiter.tenant, 0) + 1
        self.admissions += 1
        waiter.future.set_result(self.admissions)

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.tenant)  # handed a slot as it gave up: pass it on
            return
        waiter.future.cancel()
        self._add_depth(waiter.tenant, -1)
        self._forget(waiter.tenant)
        self._dead += 1
        if self._dead > 64 and self._dead * 2 > len(self._heap):
            self._heap = [e for e in self._heap if not e[2].future.done()]
            heapq.heapify(self._heap)
            self._dead = 0
            for tenant, queue in self._queues.items():
                self._queues[tenant] = deque(w for w in queue if not w.future.done())

    def _forget(self, tenant: str) -> None:
        """Drop a tenant that neither holds nor waits from the share computation."""
        if not self._held.get(tenant) and not self._depth.get(tenant):
            self._held.pop(tenant, None)
            self._weight.pop(tenant, None)

    def _add_depth(self, tenant: str, delta: int) -> None:
        depth = self._depth.get(tenant, 0) + delta
        if depth:
            self._depth[tenant] = depth
        else:
            self._depth.pop(tenant, None)
            self._queues.pop(tenant, None)  # only done waiters are left in it
        self.on_depth(tenant, delta)
