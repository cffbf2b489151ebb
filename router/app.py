"""The router's HTTP face: an OpenAI gateway plus /health, /ready and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from epdserve import __version__
from epdserve.connectors.slow_clients import DEFAULT_BODY_TIMEOUT, BodyReadTimeout
from epdserve.router.disagg import handle as disagg_handle
from epdserve.router.guard import ApiKeyCheck, BodyLimit, TenantCheck
from epdserve.router.loadstats import scrape_forever
from epdserve.router.lora_route import prepare as prepare_adapter
from epdserve.router.lora_route import with_adapters
from epdserve.router.processed import FIELD as PROCESSED
from epdserve.router.proxy import ProxyError, open_upstream, relay, request_headers
from epdserve.router.service import Router
from epdserve.router.tenant_gate import Tenancy, add_gate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProxySettings:
    """Timeouts, retry policy and request limits of the gateway."""

    connect_timeout: float = 2.0
    upstream_timeout: float = 600.0
    max_attempts: int = 3
    failure_backoff: float = 2.0
    scrape_interval: float = 1.0
    max_body_bytes: int = 32 * 1024 * 1024  # image data URLs are big
    api_key: str | None = field(default=None, repr=False)
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # a client's whole request body (408 past it)
    max_upstream_connections: int | None = 4096  # to all pods together (503 + Retry-After)
    max_keepalive_connections: int = 256  # idle upstream connections kept for reuse
    max_pod_connections: int | None = 1024  # requests in flight to one pod (then it is busy)
    tenancy: Tenancy | None = None  # tenants and the fair queue (router/tenant_gate.py)

    def upstream_limits(self) -> httpx.Limits:
        keepalive = self.max_keepalive_connections
        if self.max_upstream_connections is not None:
            keepalive = min(keepalive, self.max_upstream_connections)
        return httpx.Limits(
            max_connections=self.max_upstream_connections, max_keepalive_connections=keepalive
        )


def build_app(router: Router, settings: ProxySettings, discovery=None, disagg=None) -> FastAPI:
    """The FastAPI app; background scraping and discovery live in its lifespan.

    ``disagg`` (a ``DisaggRouters``) adds encoder/prefill/decode orchestration, used
    whenever the pool has prefill and decode pods; ``discovery`` then feeds every role.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # waiting for a free upstream connection is bounded like connecting: then 503
        timeout = httpx.Timeout(
            settings.upstream_timeout,
            connect=settings.connect_timeout,
            pool=settings.connect_timeout,
        )
        limits = settings.upstream_limits()
        app.state.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        if discovery is not None:
            discovery.start(router)
        scraped = [router, *(disagg.routers() if disagg is not None else [])]
        scrapers = [
            asyncio.create_task(scrape_forever(app.state.client, r, settings.scrape_interval))
            for r in scraped
        ]
        try:
            yield
        finally:
            for scraper in scrapers:
                scraper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraper
            if discovery is not None:
                discovery.stop()
            await app.state.client.aclose()
            router.close()
            if disagg is not None:
                disagg.close()

    app = FastAPI(title="epdserve router", lifespan=lifespan)
    tenancy = settings.tenancy
    if tenancy is not None:  # inside BodyLimit: it reads the replayed body
        app.state.fair_queue = add_gate(
            app, tenancy, router.metrics.registry, lambda: len(plain_router().available())
        )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, metrics=router.metrics)
    app.add_middleware(  # outside BodyLimit, which reads every body through it
        BodyReadTimeout,
        timeout=settings.body_timeout,
        on_timeout=router.metrics.client_errors.labels("body_timeout").inc,
    )
    if tenancy is not None:  # added last: checked first, before any body is read
        app.add_middleware(TenantCheck, identity=tenancy.identity, metrics=router.metrics)
    elif settings.api_key:
        app.add_middleware(ApiKeyCheck, api_key=settings.api_key, metrics=router.metrics)

    def plain_router() -> Router:
        """Pods for whole requests: colocated ones, else (a P/D pool) the decode pods."""
        if disagg is None or router.available():
            return router
        return disagg.decode

    def metadata_router() -> Router:
        """Pods for /v1/models, /tokenize, /detokenize: any role knows the model, so with
        no colocated or decode pod up a prefill (or encoder) pod answers."""
        target = plain_router()
        if disagg is None or target.available():
            return target
        return next((r for r in (disagg.prefill, disagg.encoder) if r and r.available()), target)

    async def forward(
        request: Request, path: str, body: dict, target: Router | None = None, content=None
    ):
        content = await request.body() if content is None else content
        target = target or plain_router()
        # tokenizing a long prompt or rendering a template must not stall other streams
        routing = await asyncio.to_thread(target.route, path, body)
        try:
            routing = await prepare_adapter(request.app.state.client, target, routing)
            upstream = await open_upstream(
                request.app.state.client,
                target,
                routing,
                request.method,
                path,
                content,
                request_headers(request.headers),
                max(settings.max_attempts, 1),
                settings.failure_backoff,
                settings.max_pod_connections,
            )
        except ProxyError as exc:
            target.metrics.client_errors.labels(exc.reason).inc()
            return exc.response()
        return StreamingResponse(
            relay(target, upstream),
            status_code=upstream.response.status_code,
            headers=upstream.headers(),
        )

    async def generation(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
        except (ValueError, RecursionError):  # bad JSON or UTF-8, 5000-digit ints, nesting
            body = None
        if not isinstance(body, dict):  # a pod answers it with its own 400
            return await forward(request, path, {})
        content = None
        if PROCESSED in body:  # pods take it as is: only this router may set it
            body = {k: v for k, v in body.items() if k != PROCESSED}
            content = json.dumps(body).encode()
        if disagg is not None and disagg.active():
            return await disagg_handle(
                request.app.state.client,
                disagg,
                settings,
                path,
                body,
                request_headers(request.headers),
            )
        return await forward(request, path, body, content=content)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        target = metadata_router()
        response = await forward(request, "/v1/models", {}, target)
        if not target.lora_policy.configured or response.status_code != 200:
            return response
        raw = b"".join([chunk async for chunk in response.body_iterator])
        return Response(with_adapters(target, raw), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await forward(request, "/tokenize", {}, metadata_router())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await forward(request, "/detokenize", {}, metadata_router())

    @app.get("/version")
    async def version() -> JSONResponse:
        # the router and its pods are one release: the pods' own answer, with no pod needed
        return JSONResponse({"version": __version__})

    @app.get("/health")
    async def health() -> Response:
        """The router is up (pods or not: /ready says whether it can serve)."""
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        if router.available() or (disagg is not None and disagg.active()):
            pods = len(router.available()) + (
                sum(len(r.available()) for r in disagg.routers()) if disagg else 0
            )
            return JSONResponse({"ready": True, "pods": pods})
        return JSONResponse({"ready": False, "pods": 0}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.update_index_gauges()
        return Response(
            router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return app
