"""The ASGI gate in front of generation routes: per-tenant counts and, when the pods are
saturated, the wait in the fair queue (router/fairqueue.py).

It sits inside ``BodyLimit``, so the whole body has arrived: while the request waits, the
next ``receive()`` can only be the client's disconnect, which takes it out of the queue. A
request keeps its slot until its response has been sent in full (streams included).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from epdserve.router.fairqueue import FairQueue, QueueFull, QueueTimeout, TenantQueueMetrics
from epdserve.router.proxy import openai_error
from epdserve.router.tenants import DEFAULT, Identity, Tenant, TenantFile, TenantLabels

log = logging.getLogger(__name__)

GATED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
ADMISSION_HEADER = b"x-epdserve-admission"  # the admission ordinal (--tenant-admission-header)
RETRY_AFTER = "1"


def scope_tenant(scope) -> Tenant | None:
    """The tenant ``TenantCheck`` (router/guard.py) put on the request, if any."""
    return scope.get("state", {}).get("tenant")


@dataclass(frozen=True)
class GateSettings:
    """``--max-inflight-per-pod`` (0: no queue), the per-tenant bound and wait, and whether
    the router sets every request's ``priority`` field (its tenant's configured priority, or
    ``DEFAULT_PRIORITY``: the client's own never reaches the pods)."""

    max_inflight_per_pod: int = 0
    reserve_per_pod: int = 0  # more slots, only for tenants under their share
    max_waiting: int = 256
    timeout: float = 30.0
    set_priority: bool = False
    admission_header: bool = False  # answer x-epdserve-admission (others' volume shows in it)


@dataclass(frozen=True)
class Tenancy:
    """Tenant identity plus the gate's settings (``RouterConfig.tenancy()``)."""

    identity: Identity
    gate: GateSettings


def add_gate(app, tenancy: Tenancy, registry, pods: Callable[[], int]) -> FairQueue | None:
    """Add the gate to ``app`` (before ``BodyLimit``: it must sit inside it); ``pods()``: how
    many pods the router can send generation requests to now. Returns the queue (None: off)."""
    settings, metrics = tenancy.gate, TenantQueueMetrics(registry)
    labels = TenantLabels(tenancy.identity.table.by_name)
    if isinstance(tenancy.identity.table, TenantFile):
        tenancy.identity.table.on_error = metrics.keys_reload_errors.inc
    queue = None
    if settings.max_inflight_per_pod > 0:

        def capacity() -> int:
            slots = settings.max_inflight_per_pod * max(1, pods())
            metrics.capacity.set(slots)
            return slots

        def depth(tenant: str, delta: int) -> None:
            metrics.queue_depth.labels(labels(tenant)).inc(delta)

        def reserve() -> int:
            return settings.reserve_per_pod * max(1, pods())

        queue = FairQueue(capacity, settings.max_waiting, settings.timeout, depth, reserve)
    app.add_middleware(
        TenantGate,
        queue=queue,
        metrics=metrics,
        labels=labels,
        set_priority=settings.set_priority,
        admission_header=settings.admission_header,
    )
    return queue


class TenantGate:
    """Counts admitted requests per tenant; queues them fairly when ``queue`` is set."""

    def __init__(
        self,
        app,
        queue: FairQueue | None,
        metrics: TenantQueueMetrics,
        labels: TenantLabels,
        set_priority: bool = False,
        admission_header: bool = False,
    ) -> None:
        self.app, self.queue, self.metrics, self.labels = app, queue, metrics, labels
        self.set_priority, self.admission_header = set_priority, admission_header

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in GATED_PATHS:
            await self.app(scope, receive, send)
            return
        tenant = scope_tenant(scope) or Tenant(DEFAULT)
        label = self.labels(tenant.name)
        first = await receive()  # the whole body: BodyLimit replays it as one message
        if first["type"] == "http.disconnect":
            return
        if self.set_priority:  # every tenant's, or an unconfigured one would choose its own
            body = with_priority(first.get("body", b""), tenant.engine_priority)
            first = {**first, "body": body}
        if self.queue is None:
            self.metrics.admitted.labels(label).inc()
            await self.app(scope, _replay(first, None, receive), send)
            return
        watch = asyncio.ensure_future(receive())  # resolves when the client leaves
        began = time.monotonic()
        seq = await self._admit(tenant, label, watch, scope, receive, send)
        if seq is None:
            return
        self.metrics.queue_seconds.labels(label).observe(time.monotonic() - began)
        self.metrics.admitted.labels(label).inc()
        self.metrics.active.set(self.queue.active)
        try:
            tagged = _tagged(send, seq) if self.admission_header else send
            await self.app(scope, _replay(first, watch, receive), tagged)
        finally:
            self.queue.release(tenant.name)
            self.metrics.active.set(self.queue.active)
            if not watch.done():
                watch.cancel()

    async def _admit(self, tenant, label, watch, scope, receive, send) -> int | None:
        """The admission ordinal, or None once the request was answered or abandoned."""
        acquire = asyncio.ensure_future(self.queue.acquire(tenant.name, tenant.weight))
        try:
            await asyncio.wait({acquire, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            acquire.cancel()
            watch.cancel()
            raise
        if not acquire.done():  # the client disconnected while waiting
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
            self.metrics.rejected.labels(label, "disconnected").inc()
            return None
        try:
            return acquire.result()
        except (QueueFull, QueueTimeout) as exc:
            watch.cancel()
            full = isinstance(exc, QueueFull)
            self.metrics.rejected.labels(label, "queue_full" if full else "queue_timeout").inc()
            log.debug("tenant %s refused: %s", tenant.name, exc)
            status, kind = (429, "RateLimitError") if full else (503, "ServiceUnavailableError")
            response = openai_error(status, str(exc), kind, headers={"Retry-After": RETRY_AFTER})
            await response(scope, receive, send)
            return None


def with_priority(body: bytes, priority: int) -> bytes:
    """The JSON body with ``priority`` set to the tenant's (anything else: unchanged)."""
    try:
        data = json.loads(body or b"{}")
    except (ValueError, RecursionError):
        return body  # the pod answers its own 400
    if not isinstance(data, dict):
        return body
    data["priority"] = priority
    return json.dumps(data).encode()


def _replay(first, watch, receive):
    """``receive`` for the app: the body, then the watcher's message, then the client's."""
    pending = [first] if watch is None else [first, watch]

    async def replayed():
        if pending:
            item = pending.pop(0)
            return item if isinstance(item, dict) else await item
        return await receive()

    return replayed


def _tagged(send, seq: int):
    async def tagged(message):
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", []), (ADMISSION_HEADER, str(seq).encode())]
            message = {**message, "headers": headers}
        await send(message)

    return tagged
