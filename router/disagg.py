"""Disaggregated serving: encoder -> prefill -> decode orchestration.

Each role has its own ``Router`` (pods, KV-event index, load) sharing one metrics registry,
and every leg takes the same path: the role's router ranks its pods (``route``), the first
that accepts gets the leg (``open_upstream``), and its answer is read or relayed. A request
goes, when the pool has those roles:

1. a chat with images -> an encoder pod, ranked by rendezvous hashing of the images
   (``ImageAffinity``) so a repeated image lands where its output is stored. Its answer
   carries the request's processed prompt (``processed``): token ids with the image
   placeholders expanded, and the images' identifiers and spans;
2. the prompt -> a prefill pod, ranked by prefix on the processed prompt's ids, with
   ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``. Its body carries
   the processed prompt and no images. With none known (a text request, or no encoder
   answer), a router whose prefill strategy routes by prefix tokenizes a text-only request
   itself and sends its ids as the processed prompt; otherwise the body goes as the client
   sent it. The prefill answer names the stored blocks and (newer pods) its processed prompt;
3. the request, without images, with the processed prompt known by then and the prefill's
   ``kv_transfer_params`` -> a decode pod, whose answer (or SSE stream) is relayed unchanged.

A request for a LoRA adapter keeps its ``model`` on every leg, and each leg ranks its role's
pods for that adapter (``lora_route.prepare``: holders first, loading it where the pool
allows), so the prefill and decode pods both serve the same adapter.

A pod that returns no processed prompt (an older pod) leaves the next legs the request as
the client sent it. Only pod failures (refused, reset before the headers, 503: see
``proxy``) move a leg on: to the next ranked pod, and once a role has none left, past the
encoder (the prefill and decode pods load the images themselves) or the prefill (the
decode pod computes the prompt). A prefill or decode pod that answers 503 asking for the
images (the encoder outputs its processed prompt named were evicted from the store since the
encoder leg: ``processed.needs_images``) gets that leg once more, with the client's images and
no processed prompt. Any other answer of any leg (4xx, 500, ...) and any failure
after a pod accepted the request go back to the client unchanged, so a request that breaks
one pod never reaches another. A prefill answer without ``kv_transfer_params`` sends the
request on without them; a request asking for ``prompt_logprobs`` skips the prefill.

Busy pods (503 + Retry-After, see ``proxy``) are skipped within a leg. When every prefill
(or decode) pod left is busy the client gets 503 + Retry-After: the pool is full, and
handing the prompt to a decode pod would only move the overload onto running streams. A
busy encoder is skipped as a failed one is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from epdserve.common.prompt_signing import PromptSigner
from epdserve.router.lora_route import prepare as prepare_adapter
from epdserve.router.processed import (
    from_answer,
    has_images,
    names_images,
    needs_images,
    router_may_tokenize,
    with_images,
    with_prompt,
)
from epdserve.router.proxy import (
    NoPodAvailable,
    ProxyError,
    Upstream,
    open_upstream,
    read_all,
    relay,
)
from epdserve.router.service import Router
from epdserve.router.strategy import ImageAffinity

log = logging.getLogger(__name__)

ROLES = ("encoder", "prefill", "decode")
# what the prefill leg (one token, never shown) does without: output options, and min_tokens,
# which a 1-token leg would refuse (it must be at most max_tokens) though decode honours it
PREFILL_DROP = (
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "prompt_logprobs",
    "min_tokens",
)


@dataclass
class DisaggRouters:
    prefill: Router
    decode: Router
    encoder: Router | None = None
    signer: PromptSigner | None = None  # the pool's key: the router's own prompts are signed

    def __post_init__(self) -> None:
        # an encoder pod's only cache is by image: whatever strategy its router was built
        # with, the role ranks by the request's images
        if self.encoder is not None and not self.encoder.strategy.uses_images:
            self.encoder.strategy = ImageAffinity()

    def routers(self) -> list[Router]:
        return [r for r in (self.encoder, self.prefill, self.decode) if r is not None]

    def active(self) -> bool:
        """P/D needs at least one prefill and one decode pod available."""
        return bool(self.prefill.available() and self.decode.available())

    def close(self) -> None:
        for router in self.routers():
            router.close()


def encoder_body(body: dict) -> dict:
    return {**body, "stream": False}


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in PREFILL_DROP}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict, prompt: dict | None, params: dict | None) -> dict:
    out = with_prompt(body, prompt)
    return {**out, "kv_transfer_params": params} if params else out


def own_prompt(
    router: Router, path: str, body: dict, signer: PromptSigner | None = None
) -> dict | None:
    """The router's processed prompt of a text-only request, when ``router`` routes by
    prefix and so tokenizes it anyway (None: it does not, or cannot); signed with the pool's
    key when the router has it."""
    if router.tokenizer is None or not router.strategy.uses_prefix:
        return None
    if not router_may_tokenize(path, body):
        return None
    ids = router.prompt_ids(path, body)
    if not ids:
        return None
    prompt = {"prompt_token_ids": ids}
    return signer.sign(prompt, body.get("cache_salt")) if signer else prompt


async def open_leg(client, router: Router, settings, path: str, body: dict, headers) -> Upstream:
    """Rank ``router``'s pods for ``body`` and open the first that accepts it (or raise a
    ``ProxyError``): the one path of every leg."""
    routing = await asyncio.to_thread(router.route, path, body)
    routing = await prepare_adapter(client, router, routing)  # both legs: the same adapter
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


async def read_leg(
    client, router: Router, settings, path: str, body: dict, headers, role: str
) -> tuple[dict | None, Response | None]:
    """A non-streamed leg: ``(answer, None)`` on a 200 (``{}`` if it is not a JSON object),
    ``(None, response)`` to return to the client as is, or ``(None, None)`` when no pod of
    the role could take it (the request moves past the role)."""
    try:
        upstream = await open_leg(client, router, settings, path, body, headers)
        raw = await read_all(router, upstream)
    except NoPodAvailable as exc:
        if exc.retry_after is not None and role != "encoder":  # the pool is full: wait
            router.metrics.client_errors.labels(exc.reason).inc()
            return None, exc.response()
        router.metrics.client_errors.labels(f"{role}_unavailable").inc()
        return None, None
    except ProxyError as exc:  # failed after accepting it; an adapter none has or loads
        router.metrics.client_errors.labels(exc.reason).inc()
        return None, exc.response()
    status = upstream.response.status_code
    if status != 200:
        return None, Response(raw, status_code=status, headers=upstream.headers())
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    return (answer if isinstance(answer, dict) else {}), None


def resend(router: Router, prompt: dict | None, status: int, headers) -> bool:
    """Whether a leg goes once more with the images: its pod found the encoder outputs the
    processed prompt named in no store (evicted since the encoder leg) and has no pixels."""
    if not (names_images(prompt) and needs_images(status, headers)):
        return False
    router.metrics.upstream_retries.labels("resend_images").inc()
    return True


async def handle(
    client: httpx.AsyncClient,
    routers: DisaggRouters,
    settings,
    path: str,
    body: dict,
    headers: dict,
) -> Response:
    """Serve one generation request through the disaggregated pool."""
    prompt = None
    if routers.encoder is not None and routers.encoder.available() and has_images(path, body):
        answer, early = await read_leg(
            client, routers.encoder, settings, path, encoder_body(body), headers, "encoder"
        )
        if early is not None:
            return early
        prompt = from_answer(answer)  # None from an older pod: the legs go on as before
    params = None
    if body.get("prompt_logprobs") is None:  # decode pods recompute those prompts anyway
        if prompt is None:
            prompt = await asyncio.to_thread(
                own_prompt, routers.prefill, path, body, routers.signer
            )
        answer, early = await read_leg(
            client,
            routers.prefill,
            settings,
            path,
            prefill_body(with_prompt(body, prompt)),
            headers,
            "prefill",
        )
        if early is not None and resend(routers.prefill, prompt, early.status_code, early.headers):
            prompt = None  # the pod makes it again, from the images
            again = prefill_body(with_images(body))
            answer, early = await read_leg(
                client, routers.prefill, settings, path, again, headers, "prefill"
            )
        if early is not None:
            return early
        if answer is not None:
            params = answer.get("kv_transfer_params")
            if params is None:
                routers.prefill.metrics.client_errors.labels("prefill_no_params").inc()
            prompt = from_answer(answer) or prompt
    try:
        upstream = await open_leg(
            client, routers.decode, settings, path, decode_body(body, prompt, params), headers
        )
        if resend(routers.decode, prompt, upstream.response.status_code, upstream.response.headers):
            await read_all(routers.decode, upstream)  # releases the pod
            again = decode_body(with_images(body), None, params)
            upstream = await open_leg(client, routers.decode, settings, path, again, headers)
    except ProxyError as exc:
        routers.decode.metrics.client_errors.labels(exc.reason).inc()
        return exc.response()
    return StreamingResponse(
        relay(routers.decode, upstream),
        status_code=upstream.response.status_code,
        headers=upstream.headers(),
    )
