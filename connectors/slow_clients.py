"""Keeping slow clients from holding a server: header and body read deadlines, uvicorn's
concurrency limit, and the file-descriptor limit. Shared by engine pods and the router,
hence here, the one folder both may import (no torch).

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``), but once a byte has
arrived it waits for the rest of the request forever, and its httptools parser bounds
neither the time nor the size of the headers. So:

- ``guarded_protocol`` subclasses uvicorn's HTTP protocol: the request line and headers must
  arrive within ``header_timeout`` seconds of the connection opening (or of the previous
  response, plus the keep-alive allowance) and within ``max_header_bytes``; else the
  connection is answered 408 or 431 and closed.
- ``BodyReadTimeout`` (ASGI) gives the body ``timeout`` seconds from its first read: past
  that, 408 and close. It wraps ``receive`` only, so it must sit outside the middleware that
  buffers the body (which must read every body itself, before the app's own parser could
  turn the timeout into a 400).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass

log = logging.getLogger("epdserve.server")

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_LIMIT_CONCURRENCY = 4096  # connections + requests; above 1,000 slow connections


@dataclass(frozen=True)
class HTTPLimits:
    """What one HTTP server (an engine pod, the router) allows its clients."""

    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY  # uvicorn: 503 beyond
    timeout_keep_alive: float = 5.0  # idle keep-alive connections close after this
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # request line + headers
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # whole body, from its first read
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency: must be at least 1, got {self.limit_concurrency}")

    def uvicorn_options(self) -> dict:
        """Keyword arguments for ``uvicorn.Config`` (the body deadline is middleware)."""
        if self.limit_concurrency:
            raise_fd_limit(self.limit_concurrency + 64)  # + listening socket, ZMQ, files
        return {
            "http": guarded_protocol(self.header_timeout, self.max_header_bytes),
            "limit_concurrency": self.limit_concurrency,
            "timeout_keep_alive": self.timeout_keep_alive,
        }


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": reason, "param": None, "code": status}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _HeaderDeadline:
    """Mixin over a uvicorn HTTP protocol class (httptools or h11): both create a new
    ``self.cycle`` once a request's headers are complete, which is what is watched."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own refusal past limit_concurrency is a plain-text 503 without
        # Retry-After, which a router cannot tell from a broken pod: the same check is made
        # here instead, answering in the API's error shape with Retry-After
        limit, self.limit_concurrency = self.limit_concurrency, None
        if limit is not None:
            self.app = _concurrency_guard(self.app, self.connections, self.tasks, limit)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_bytes = 0
        self._header_timer = None
        self._await_headers(self.header_timeout)

    def _await_headers(self, seconds: float) -> None:
        self._header_bytes = 0
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(seconds, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None:  # a request is in progress: its body, or pipelined
            super().data_received(data)
            return
        cycle = self.cycle
        self._header_bytes += len(data)
        super().data_received(data)
        if self.cycle is not cycle:  # the headers are complete
            self._cancel_header_timer()
        elif self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._refuse(431, "Request Header Fields Too Large", "request headers are too large")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():  # the next request's headers, after
            self._await_headers(self.timeout_keep_alive + self.header_timeout)  # keep-alive

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._header_bytes:
            self._refuse(408, "Request Timeout", "request headers were not received in time")
        else:
            self.transport.close()

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self._cancel_header_timer()
        self.transport.write(_raw_response(status, reason, message))
        self.transport.close()


def guarded_protocol(
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    base: type | None = None,
) -> type:
    """uvicorn's ``http=`` protocol class (httptools when installed, else h11) with a
    deadline and a size bound on request headers."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    attrs = {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes}
    return type(f"Guarded{base.__name__}", (_HeaderDeadline, base), attrs)


class BodyTimedOut(Exception):
    """The request body did not arrive in time (raised from ``receive``)."""


class BodyReadTimeout:
    """408 and close when a request body takes longer than ``timeout`` seconds to arrive."""

    def __init__(self, app, timeout: float, on_timeout=None):
        self.app, self.timeout, self.on_timeout = app, timeout, on_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.timeout:
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        body_done, started = False, False

        async def timed_receive():
            nonlocal body_done
            if body_done:  # later reads wait for a disconnect: no deadline
                return await receive()
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.0))
            except TimeoutError:
                raise BodyTimedOut from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except BodyTimedOut:
            if self.on_timeout is not None:
                self.on_timeout()
            if not started:
                await _send_error(send, 408, "request body was not received in time")


# Kubernetes probes: a pod at its limit is busy, not dead or unready, so a GET of these is
# answered within a small allowance over the limit (a liveness probe that failed there would
# restart a saturated pod and lose every request it holds)
PROBE_PATHS = frozenset({"/health", "/ready"})
PROBE_ALLOWANCE = 16


def _concurrency_guard(app, connections: set, tasks: set, limit: int):
    """``app`` behind uvicorn's limit_concurrency test (this request's task is already in
    ``tasks``), refusing with 503 + Retry-After past it; probes get ``PROBE_ALLOWANCE``
    more."""

    async def guarded(scope, receive, send) -> None:
        bound = limit
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] in PROBE_PATHS:
            bound += PROBE_ALLOWANCE
        if scope["type"] == "http" and (len(connections) >= bound or len(tasks) > bound):
            log.warning("exceeded the concurrency limit (%d): 503", limit)
            message = f"the server is at its concurrency limit ({limit}); retry later"
            await _send_error(send, 503, message, "ServiceUnavailableError", None, b"1")
            return
        await app(scope, receive, send)

    return guarded


async def _send_error(
    send,
    status: int,
    message: str,
    kind: str = "RequestTimeout",
    param: str | None = "body",
    retry_after: bytes | None = None,
) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", retry_after))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft open-file limit towards its hard limit (every connection
    is a descriptor; the usual soft default of 1,024 is below 1,000 slow clients plus real
    ones). Returns the soft limit now; warns if it stays below ``wanted``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d: %s", soft, exc)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "open-file limit %d is below the %d connections allowed (--limit-concurrency)",
            soft,
            wanted,
        )
    return soft
