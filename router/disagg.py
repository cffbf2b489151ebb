"""Disaggregated serving: encoder -> prefill -> decode orchestration.

Each role has its own ``Router`` (pods, KV-event index, load) sharing one metrics registry.
A request goes, when the pool has those roles:

1. images (chat ``image_url`` parts) -> one encoder pod, chosen by rendezvous hashing of
   the images so a repeated image lands where its output is stored (best effort: on failure
   the prefill/decode pods encode it themselves);
2. the prompt -> a prefill pod (prefix-aware), with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``; its answer names the stored blocks;
3. the original request plus those ``kv_transfer_params`` -> a decode pod (load-aware),
   whose answer (or SSE stream) is relayed unchanged.

Only pod failures (refused, reset before the headers, 503: see ``proxy``) move a leg on:
to the next ranked pod, and once a role has none left, past the prefill (or encoder) step
to the decode pod, which then computes the prompt (or encodes the images) itself. Any
other answer of any leg (4xx, 500, ...) and any failure after a pod accepted the request
go back to the client unchanged, so a request that breaks one pod never reaches another.
A prefill answer without ``kv_transfer_params`` also sends the request on without them.

Busy pods (503 + Retry-After, see ``proxy``) are skipped within a leg. When every prefill
(or decode) pod left is busy the client gets 503 + Retry-After: the pool is full, and
handing the prompt to a decode pod would only move the overload onto running streams. A
busy encoder is skipped as a failed one is (the prefill/decode pods encode the images).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from epdserve.router.proxy import (
    NoPodAvailable,
    ProxyError,
    UpstreamFailed,
    open_upstream,
    pod_failure_cause,
    read_all,
    relay,
    retry_after,
)
from epdserve.router.service import Router

log = logging.getLogger(__name__)

ROLES = ("encoder", "prefill", "decode")
PREFILL_DROP = ("stream_options", "logprobs", "top_logprobs", "echo", "prompt_logprobs")


@dataclass
class DisaggRouters:
    prefill: Router
    decode: Router
    encoder: Router | None = None

    def routers(self) -> list[Router]:
        return [r for r in (self.encoder, self.prefill, self.decode) if r is not None]

    def active(self) -> bool:
        """P/D needs at least one prefill and one decode pod available."""
        return bool(self.prefill.available() and self.decode.available())

    def close(self) -> None:
        for router in self.routers():
            router.close()


def image_urls(body: dict) -> list[str]:
    urls = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if isinstance(url, str):
                    urls.append(url)
    return urls


def pick_encoder(pods, urls: list[str]):
    """Rendezvous hashing: the same images always map to the same live encoder pod."""
    key = hashlib.blake2b("\n".join(urls).encode(), digest_size=16).digest()
    return max(pods, key=lambda p: hashlib.blake2b(key + p.name.encode(), digest_size=8).digest())


def with_prompt_ids(router: Router, path: str, body: dict) -> dict:
    """The body both legs get: a text-only prompt as this router tokenized it, so prefill
    and decode pods neither render nor tokenize it again (chat: ``prompt_token_ids``;
    completions: the ids as the prompt, unless ``echo`` wants the prompt's own text)."""
    if image_urls(body) or "prompt_token_ids" in body:
        return body
    chat = path.endswith("/chat/completions")
    if not chat and (not isinstance(body.get("prompt"), str) or body.get("echo")):
        return body
    ids = router.prompt_ids(path, body)
    if ids is None:
        return body
    return {**body, "prompt_token_ids": ids} if chat else {**body, "prompt": ids}


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in PREFILL_DROP}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


async def encode_images(
    client: httpx.AsyncClient, routers: DisaggRouters, settings, path: str, body, headers
) -> Response | None:
    """None when done or skipped (a pod failure: the prefill/decode pods will encode the
    images themselves), or the encoder's error answer to return to the client as is."""
    urls = image_urls(body) if path.endswith("/chat/completions") else []
    encoder = routers.encoder
    pods = encoder.available() if encoder is not None and urls else []
    if not pods:
        return None
    pod = pick_encoder(pods, urls)
    encoder.track_inflight(pod, +1)
    try:
        resp = await client.post(
            pod.endpoint.url + path, json={**body, "stream": False}, headers=headers
        )
    except httpx.PoolTimeout:  # the router's connections are all in use: skip this step
        encoder.metrics.upstream_errors.labels(pod.name, "router_connections_full").inc()
        return None
    except httpx.HTTPError as exc:
        cause = pod_failure_cause(exc)
        encoder.metrics.upstream_errors.labels(pod.name, cause or type(exc).__name__).inc()
        log.warning("encoder pod %s failed: %s", pod.name, exc)
        if cause is None:
            timed_out = isinstance(exc, httpx.TimeoutException)
            return UpstreamFailed(f"encoder pod {pod.name} failed", timed_out).response()
        pod.mark_failed(settings.failure_backoff)
        return None
    finally:
        encoder.track_inflight(pod, -1)
    if resp.status_code == 503:
        wait = retry_after(resp.headers)
        cause = "busy" if wait is not None else "http_503"
        encoder.metrics.upstream_errors.labels(pod.name, cause).inc()
        if wait is not None:
            pod.mark_busy(wait)
        else:
            pod.mark_failed(settings.failure_backoff)
        return None
    pod.mark_ok()
    if resp.status_code >= 300:
        encoder.metrics.upstream_errors.labels(pod.name, f"http_{resp.status_code}").inc()
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
    encoder.metrics.requests.labels(pod.name, "encoder_affinity").inc()
    return None


async def _open(client, router: Router, settings, path: str, body: dict, headers: dict):
    """Rank ``router``'s pods for ``body`` and open the first that answers (or raise)."""
    routing = await asyncio.to_thread(router.route, path, body)
    return await open_upstream(
        client,
        router,
        routing,
        "POST",
        path,
        json.dumps(body).encode(),
        headers,
        max(settings.max_attempts, 1),
        settings.failure_backoff,
        settings.max_pod_connections,
    )


async def run_prefill(
    client, routers: DisaggRouters, settings, path: str, body: dict, headers: dict
) -> tuple[dict | None, Response | None]:
    """``(kv_transfer_params, None)``, or ``(None, response)`` to return to the client as is."""
    try:
        upstream = await _open(client, routers.prefill, settings, path, prefill_body(body), headers)
        raw = await read_all(routers.prefill, upstream)
    except NoPodAvailable as exc:
        if exc.retry_after is not None:  # the pool is full, not broken: the client waits
            routers.prefill.metrics.client_errors.labels(exc.reason).inc()
            return None, exc.response()
        routers.prefill.metrics.client_errors.labels("prefill_unavailable").inc()
        return None, None
    except UpstreamFailed as exc:
        routers.prefill.metrics.client_errors.labels(exc.reason).inc()
        return None, exc.response()
    status = upstream.response.status_code
    if status != 200:
        return None, Response(raw, status_code=status, headers=upstream.headers())
    try:
        params = json.loads(raw).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    if params is None:
        routers.prefill.metrics.client_errors.labels("prefill_no_params").inc()
    return params, None


async def handle(
    client: httpx.AsyncClient,
    routers: DisaggRouters,
    settings,
    path: str,
    body: dict,
    headers: dict,
) -> Response:
    """Serve one generation request through the disaggregated pool."""
    early = await encode_images(client, routers, settings, path, body, headers)
    if early is not None:
        return early
    body = await asyncio.to_thread(with_prompt_ids, routers.decode, path, body)
    params = None
    if body.get("prompt_logprobs") is None:  # decode pods recompute those prompts anyway
        params, early = await run_prefill(client, routers, settings, path, body, headers)
        if early is not None:
            return early
    dbody = {**body, "kv_transfer_params": params} if params else body
    try:
        upstream = await _open(client, routers.decode, settings, path, dbody, headers)
    except ProxyError as exc:
        routers.decode.metrics.client_errors.labels(exc.reason).inc()
        return exc.response()
    return StreamingResponse(
        relay(routers.decode, upstream),
        status_code=upstream.response.status_code,
        headers=upstream.headers(),
    )
