"""Plain ASGI middlewares of the engine's API server (Starlette's ``BaseHTTPMiddleware``
would re-stream every SSE chunk through extra tasks and queues)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from epdserve.engine.entrypoints.openai.errors import error_response

PROTECTED = ("/v1", "/tokenize", "/detokenize")  # probes, /metrics and /version stay open
LINGER_BYTES = 4 << 20  # body a refused client may still send before its answer...
LINGER_SECONDS = 2.0  # ...and for how long: past either, the connection just closes


async def discard_body(scope, receive) -> None:
    """Read and drop the request body before an early error answer, within LINGER_BYTES
    and LINGER_SECONDS. Closing a socket with unread bytes resets it, and the reset can
    destroy the answer on its way (a router forwarding the body then sees a dead pod)."""
    headers = dict(scope["headers"])
    length = headers.get(b"content-length")
    if length is None and b"transfer-encoding" not in headers:
        return  # no body
    if length is not None and (not length.isdigit() or not 0 < int(length) <= LINGER_BYTES):
        return

    async def drain() -> None:
        size = 0
        while size <= LINGER_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))

    with contextlib.suppress(TimeoutError):  # a bound, not a fault: the 401 follows
        await asyncio.wait_for(drain(), LINGER_SECONDS)


class APIKeyMiddleware:
    """The API routes need ``Authorization: Bearer <key>`` (constant-time compare). It is
    the outermost middleware and decides on headers only: a client without the key never
    has its body parsed; at most LINGER_BYTES of it are read and dropped so that the 401
    arrives (the 401 closes the connection)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                await discard_body(scope, receive)
                response = error_response(
                    401, "Unauthorized: missing or invalid API key", headers={"connection": "close"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from Content-Length, else as soon as the
    body read so far passes the limit, so an endless body is never buffered past it. Every
    body is read here, so a read deadline (``BodyReadTimeout``, outside this) ends the
    request with its own 408, not as a parse error of the app."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self):
        return error_response(
            413,
            f"request body is larger than {self.max_bytes} bytes",
            "body",
            headers={"connection": "close"},  # the rest of the body is never read
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # disconnect notices, as the server sends them
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
