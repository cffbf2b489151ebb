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

A prefill 4xx goes back to the client as is; a prefill failure (5xx, timeout, no params)
sends the request to a decode pod without params, which then computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from epdserve.router.proxy import NoPodAvailable, open_upstream, openai_error, relay
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


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in PREFILL_DROP}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


async def encode_images(
    client: httpx.AsyncClient, routers: DisaggRouters, path: str, body: dict, headers: dict
) -> None:
    urls = image_urls(body) if path.endswith("/chat/completions") else []
    pods = routers.encoder.available() if routers.encoder is not None and urls else []
    if not pods:
        return
    pod = pick_encoder(pods, urls)
    routers.encoder.track_inflight(pod, +1)
    try:
        resp = await client.post(
            pod.endpoint.url + path, json={**body, "stream": False}, headers=headers
        )
        if resp.status_code >= 400:
            routers.encoder.metrics.upstream_errors.labels(
                pod.name, f"http_{resp.status_code}"
            ).inc()
        else:
            routers.encoder.metrics.requests.labels(pod.name, "encoder_affinity").inc()
    except httpx.HTTPError as exc:  # the prefill/decode pods will encode it themselves
        routers.encoder.metrics.upstream_errors.labels(pod.name, type(exc).__name__).inc()
        log.warning("encoder pod %s failed: %s", pod.name, exc)
    finally:
        routers.encoder.track_inflight(pod, -1)


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
    )


async def run_prefill(
    client, routers: DisaggRouters, settings, path: str, body: dict, headers: dict
) -> tuple[dict | None, Response | None]:
    """``(kv_transfer_params, None)``, or ``(None, response)`` to return to the client as is."""
    try:
        upstream = await _open(client, routers.prefill, settings, path, prefill_body(body), headers)
    except NoPodAvailable:
        routers.prefill.metrics.client_errors.labels("prefill_unavailable").inc()
        return None, None
    status = upstream.response.status_code
    raw = b"".join([chunk async for chunk in relay(routers.prefill, upstream)])
    if 400 <= status < 500:
        return None, Response(raw, status_code=status, media_type="application/json")
    try:
        params = json.loads(raw).get("kv_transfer_params") if status == 200 else None
    except (json.JSONDecodeError, AttributeError):
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
    await encode_images(client, routers, path, body, headers)
    params = None
    if body.get("prompt_logprobs") is None:  # decode pods recompute those prompts anyway
        params, early = await run_prefill(client, routers, settings, path, body, headers)
        if early is not None:
            return early
    dbody = {**body, "kv_transfer_params": params} if params else body
    try:
        upstream = await _open(client, routers.decode, settings, path, dbody, headers)
    except NoPodAvailable as exc:
        routers.decode.metrics.client_errors.labels("no_pod").inc()
        return openai_error(503, str(exc), "ServiceUnavailableError")
    return StreamingResponse(
        relay(routers.decode, upstream),
        status_code=upstream.response.status_code,
        headers=upstream.headers(),
    )
