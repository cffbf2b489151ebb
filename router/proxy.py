"""Forwarding one request to the ranked pods: retry until the first byte, then stream."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse

from epdserve.router.pods import PodState
from epdserve.router.service import Router, Routing

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})
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


def openai_error(status: int, message: str, kind: str) -> JSONResponse:
    """An error in OpenAI's JSON shape."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class NoPodAvailable(Exception):
    """Every candidate pod failed before sending a byte (or there were none)."""


def request_headers(headers) -> dict[str, str]:
    """Client headers to forward upstream."""
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
) -> Upstream:
    """Try the ranked pods in order; the first that answers with a byte wins."""
    for attempt, decision in enumerate(routing.order[:max_attempts]):
        pod = router.pod(decision.pod)
        if pod is None:
            continue
        router.track_inflight(pod, +1)
        try:
            upstream = await _try_pod(client, pod, method, path, content, headers)
        except (httpx.HTTPError, _RetryableStatus) as exc:
            router.track_inflight(pod, -1)
            kind = type(exc).__name__
            router.metrics.upstream_errors.labels(pod.name, kind).inc()
            log.warning("pod %s failed before streaming (%s): %s", pod.name, kind, exc)
            pod.mark_failed(failure_backoff)
            continue
        except BaseException:
            router.track_inflight(pod, -1)
            raise
        pod.mark_ok()
        router.record(routing, pod.name, attempt)
        return upstream
    raise NoPodAvailable("no pod could serve the request")


class _RetryableStatus(Exception):
    pass


async def _try_pod(client, pod: PodState, method, path, content, headers) -> Upstream:
    request = client.build_request(
        method, pod.endpoint.url + path, content=content, headers=headers
    )
    response = await client.send(request, stream=True)
    try:
        if response.status_code in RETRY_STATUSES:
            raise _RetryableStatus(f"HTTP {response.status_code}")
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
