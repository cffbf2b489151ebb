"""Forwarding one request to the ranked pods: retry only pod refusals, then stream.

A *pod failure* is the pod refusing a request before accepting it: the connection is
refused or times out, it is closed or reset before the response headers, or the pod
answers 503 (engine pods say 503 only up front: not ready, core already dead). Those move
the request on to the next ranked pod (``max_attempts`` in all) and count against the
pod's failure backoff. A *busy* pod (503 with ``Retry-After``: its admission bound is
reached; or this router already holds ``max_pod_connections`` requests on it) is skipped
without counting as a failure: it is tried again after its Retry-After, and when every
ranked pod is busy the client gets 503 with the shortest Retry-After.
A 503 that asks for the request again with its images (``processed.needs_images``) is an
answer, not a refusal. Any other answer (4xx, 500, ...) goes to the client unchanged, and an
error after the request was accepted (a read timeout, a reset after the headers) is never
retried: the request itself may be what broke the pod, and it must not take the next pod
down too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse

from epdserve.router.decisions import Charge
from epdserve.router.pods import PodState
from epdserve.router.processed import needs_images
from epdserve.router.service import Router, Routing

log = logging.getLogger(__name__)

REFUSED_STATUS = 503
BUSY_RETRY_AFTER = 1.0  # s: a pod this router fills, or the router's own full pool
MAX_BUSY_WAIT = 30.0  # s: a Retry-After keeps a pod out of rotation at most this long
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
    }
)


@dataclass
class Upstream:
    """An upstream response whose first body chunk has already arrived."""

    pod: PodState
    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes]

    def headers(self) -> dict[str, str]:
        """Response headers worth passing to the client."""
        return {k: v for k, v in self.response.headers.items() if k.lower() not in HOP_BY_HOP}


def openai_error(status: int, message: str, kind: str, headers=None) -> JSONResponse:
    """An error in OpenAI's JSON shape."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class ProxyError(Exception):
    """The router answers the client itself (``response()``): no pod gave an answer."""

    status = 502
    kind = "BadGatewayError"
    reason = "upstream_failed"  # the request_failures metric's label

    def response(self) -> JSONResponse:
        return openai_error(self.status, str(self), self.kind)


class NoPodAvailable(ProxyError):
    """Every candidate pod refused the request (or there were none). ``retry_after``: the
    shortest a busy one asked for (None: none was busy, only failed)."""

    status = 503
    kind = "ServiceUnavailableError"
    reason = "no_pod"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        if retry_after is not None:
            self.reason = "all_busy"

    def response(self) -> JSONResponse:
        if self.retry_after is None:
            return super().response()
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
        return openai_error(self.status, str(self), self.kind, headers)


class UpstreamFailed(ProxyError):
    """A pod accepted the request, then failed without an answer (not retried)."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        if timed_out:
            self.status, self.kind = 504, "GatewayTimeoutError"


class PodFailure(Exception):
    """The pod refused the request before accepting it; ``cause`` labels the metrics."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


class PodBusy(PodFailure):
    """The pod cannot take the request now; try it again after ``retry_after`` seconds."""

    def __init__(self, cause: str, retry_after: float) -> None:
        super().__init__(cause, f"retry after {retry_after}s")
        self.retry_after = retry_after


def retry_after(headers) -> float | None:
    """A 503's ``Retry-After`` in seconds (delta-seconds form only), or None."""
    value = headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_BUSY_WAIT) if seconds is not None else None


def pod_failure_cause(exc: httpx.HTTPError) -> str | None:
    """The retry cause of an error raised before the response headers, or None when the
    pod may have accepted the request (a read or write timeout: it may be what hangs)."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect_timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect_refused"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "closed_before_headers"
    return None


def request_headers(headers) -> dict[str, str]:
    """Client headers to forward upstream (``Authorization`` included: pods may share the
    router's API key)."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


async def open_upstream(
    client: httpx.AsyncClient,
    router: Router,
    routing: Routing,
    method: str,
    path: str,
    content: bytes,
    headers: dict[str, str],
    max_attempts: int,
    failure_backoff: float,
    max_pod_connections: int | None = None,
) -> Upstream:
    """Try the ranked pods in order until one accepts the request: at most ``max_attempts``
    failing ones, any number of busy ones. Raises a ProxyError."""
    candidates = [router.pod(d.pod) for d in routing.order]
    candidates = [pod for pod in candidates if pod is not None]
    failures, busy_wait, moved_on = 0, None, None
    for attempt, pod in enumerate(candidates):
        if failures >= max_attempts:
            break
        if moved_on is not None:
            router.metrics.upstream_retries.labels(moved_on).inc()
        if max_pod_connections is not None and pod.inflight >= max_pod_connections:
            busy = PodBusy("pod_connections_full", BUSY_RETRY_AFTER)
            busy_wait, moved_on = _count_busy(router, pod, busy, busy_wait), busy.cause
            continue
        router.track_inflight(pod, +1)
        charge = routing.charge or Charge(router)
        charge.move_to(pod, routing)
        expected = routing.keys.get(pod.name, [])
        router.pending.add(pod.name, expected)  # cached there from now on (router/pending.py)
        try:
            upstream = await _try_pod(client, pod, method, path, content, headers)
        except PodBusy as busy:
            router.track_inflight(pod, -1)
            router.pending.discard(pod.name, expected)
            busy_wait, moved_on = _count_busy(router, pod, busy, busy_wait), busy.cause
            continue
        except PodFailure as failure:
            router.track_inflight(pod, -1)
            router.pending.discard(pod.name, expected)
            _count_pod_failure(router, pod, failure, failure_backoff)
            failures, moved_on = failures + 1, failure.cause
            continue
        except httpx.PoolTimeout as exc:  # the router's own connection cap, not the pod
            router.track_inflight(pod, -1)
            router.metrics.upstream_errors.labels(pod.name, "router_connections_full").inc()
            raise NoPodAvailable(
                "the router holds its maximum of upstream connections", BUSY_RETRY_AFTER
            ) from exc
        except httpx.HTTPError as exc:
            router.track_inflight(pod, -1)
            kind = type(exc).__name__
            router.metrics.upstream_errors.labels(pod.name, kind).inc()
            log.warning("pod %s failed after accepting a request (%s): %s", pod.name, kind, exc)
            raise UpstreamFailed(
                f"pod {pod.name} failed: {kind}", isinstance(exc, httpx.TimeoutException)
            ) from exc
        except BaseException:
            router.track_inflight(pod, -1)
            raise
        finally:
            charge.release()
        pod.mark_ok()  # it answered, whatever the status: the pod is up
        router.record(routing, pod.name, attempt)
        return upstream
    if busy_wait is not None:
        raise NoPodAvailable("every pod is busy; retry later", busy_wait)
    raise NoPodAvailable("no pod could serve the request")


def _count_pod_failure(router, pod, failure: PodFailure, backoff: float) -> None:
    router.metrics.upstream_errors.labels(pod.name, failure.cause).inc()
    log.warning("pod %s refused a request (%s)", pod.name, failure)
    pod.mark_failed(backoff)


def _count_busy(router, pod, busy: PodBusy, shortest: float | None) -> float:
    """Note a busy pod; returns the shortest Retry-After seen so far."""
    router.metrics.upstream_errors.labels(pod.name, busy.cause).inc()
    log.debug("pod %s is busy (%s)", pod.name, busy)
    pod.mark_busy(busy.retry_after)
    return busy.retry_after if shortest is None else min(shortest, busy.retry_after)


async def _try_pod(client, pod: PodState, method, path, content, headers) -> Upstream:
    request = client.build_request(
        method, pod.endpoint.url + path, content=content, headers=headers
    )
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        cause = pod_failure_cause(exc)
        if cause is None:
            raise
        raise PodFailure(cause, str(exc) or type(exc).__name__) from exc
    try:
        # a 503 asking for the images is the pod's answer, not a refusal (router/disagg.py)
        if response.status_code == REFUSED_STATUS and not needs_images(503, response.headers):
            wait = retry_after(response.headers)
            if wait is not None:
                raise PodBusy("busy", wait)
            raise PodFailure("http_503", "the pod is not accepting requests")
        chunks = response.aiter_raw()
        first = await anext(chunks, b"")
    except BaseException:
        await response.aclose()
        raise
    return Upstream(pod, response, first, chunks)


async def relay(router: Router, upstream: Upstream) -> AsyncIterator[bytes]:
    """Yield the upstream body chunk by chunk; always release the pod and connection."""
    try:
        if upstream.first:
            yield upstream.first
        async for chunk in upstream.rest:
            yield chunk
    except httpx.HTTPError as exc:
        router.metrics.upstream_errors.labels(upstream.pod.name, "mid_stream").inc()
        log.warning("pod %s broke a response mid-stream: %s", upstream.pod.name, exc)
    finally:
        await upstream.response.aclose()
        router.track_inflight(upstream.pod, -1)


async def read_all(router: Router, upstream: Upstream) -> bytes:
    """The whole upstream body; raises UpstreamFailed if the pod breaks it off."""
    try:
        return upstream.first + b"".join([chunk async for chunk in upstream.rest])
    except httpx.HTTPError as exc:
        router.metrics.upstream_errors.labels(upstream.pod.name, "mid_body").inc()
        raise UpstreamFailed(
            f"pod {upstream.pod.name} broke its answer off", isinstance(exc, httpx.TimeoutException)
        ) from exc
    finally:
        await upstream.response.aclose()
        router.track_inflight(upstream.pod, -1)
