"""Plain ASGI guards in front of every route: the API key and the request-body limit.

Plain ASGI on purpose: Starlette's ``BaseHTTPMiddleware`` would re-buffer every SSE
stream through extra tasks and queues.
"""

from __future__ import annotations

import hmac

from epdserve.router.metrics import RouterMetrics
from epdserve.router.proxy import openai_error
from epdserve.router.tenants import BadTenantHeader, Identity, KeyedTenantHeader

# probes, scrapes and /version need no key (as on an engine pod)
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})


def _header(scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k.lower() == name), None)


class ApiKeyCheck:
    """Every route but the probe/scrape ones needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str, metrics: RouterMetrics) -> None:
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    def authorized(self, scope) -> bool:
        header = _header(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        # compare_digest runs in time independent of where the token differs
        return hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            if not self.authorized(scope):
                await _unauthorized(self.metrics)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _unauthorized(metrics: RouterMetrics):
    metrics.client_errors.labels("unauthorized").inc()
    return openai_error(
        401,
        "missing or invalid API key (Authorization: Bearer <key>)",
        "AuthenticationError",
        headers={"www-authenticate": "Bearer"},
    )


class TenantCheck:
    """``ApiKeyCheck`` with tenants (router/tenants.py ``Identity`` has the rules): puts
    the request's ``Tenant`` in ``scope["state"]["tenant"]``, answers 401 to a key that is
    neither a tenant's nor the shared ``--api-key``, 400 to a bad gateway tenant header, 403
    to a header naming a tenant that has keys.
    A tenant's key never reaches the pods: upstream it becomes the shared key (or none)."""

    def __init__(self, app, identity: Identity, metrics: RouterMetrics) -> None:
        self.app, self.identity, self.metrics = app, identity, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else None
        header = _header(scope, self.identity.header) if self.identity.header else None
        try:
            tenant = self.identity.identify(token, header)
        except BadTenantHeader as exc:
            self.metrics.client_errors.labels("bad_tenant_header").inc()
            await openai_error(400, str(exc), "BadRequestError")(scope, receive, send)
            return
        except KeyedTenantHeader as exc:
            self.metrics.client_errors.labels("keyed_tenant_header").inc()
            await openai_error(403, str(exc), "PermissionDeniedError")(scope, receive, send)
            return
        if tenant is None:
            await _unauthorized(self.metrics)(scope, receive, send)
            return
        scope = dict(scope, state={**scope.get("state", {}), "tenant": tenant})
        if token and self.identity.table.current().by_key(token) is not None:
            scope["headers"] = self._upstream_auth(scope["headers"])
        await self.app(scope, receive, send)

    def _upstream_auth(self, headers):
        kept = [(k, v) for k, v in headers if k.lower() != b"authorization"]
        if self.identity.api_key is not None:
            kept.append((b"authorization", b"Bearer " + self.identity.api_key))
        return kept


class BodyLimit:
    """Answers 413 to a request body over ``max_bytes``, judged by Content-Length up front
    and by counting while a chunked body arrives; never holds more than the limit.

    The body is read here and replayed to the app, which buffers it whole anyway."""

    def __init__(self, app, max_bytes: int, metrics: RouterMetrics) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _reject(self, scope, receive, send) -> None:
        self.metrics.client_errors.labels("body_too_large").inc()
        response = openai_error(
            413,
            f"request body is larger than the router's limit of {self.max_bytes} bytes",
            "RequestTooLargeError",
            headers={"connection": "close"},  # the rest of the body is never read
        )
        await response(scope, receive, send)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the client's disconnect, as usual

    return replayed
