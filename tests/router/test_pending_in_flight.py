"""A prompt counts as cached on the pod it was sent to from the moment it is sent, not from its
answer: a second request with the same prefix that comes while the first is still in its
prefill (no first byte, no KV events yet) goes to the same pod. Pods are in-process HTTP
handlers; the router's own proxy sends to them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from epdserve.router.keys import request_keys
from epdserve.router.pods import PodEndpoint
from epdserve.router.proxy import NoPodAvailable, open_upstream
from epdserve.router.service import Router
from epdserve.router.strategy import make_strategy

IDS = list(range(100, 164))  # 4 blocks of 16 (the router's default block size)
KEYS = request_keys(IDS, 16)


def body() -> dict:
    return {"model": "m", "prompt": "x", "processed_prompt": {"prompt_token_ids": IDS}}


def ok() -> httpx.Response:
    return httpx.Response(200, stream=httpx.ByteStream(b'{"ok": true}'))


def make_router() -> Router:
    router = Router(make_strategy("prefix+load"), None, subscribe=False)
    for name in ("a", "b"):
        router.add_pod(PodEndpoint(name, f"http://{name}:1", f"tcp://{name}:2", None))
    return router


async def send(client, router: Router, routing):
    content = json.dumps(body()).encode()
    return await open_upstream(
        client, router, routing, "POST", "/v1/completions", content, {}, 2, 0
    )


def test_a_second_request_during_the_firsts_prefill_goes_to_the_same_pod():
    async def scenario():
        router, arrived, release = make_router(), asyncio.Event(), asyncio.Event()

        async def pod(request: httpx.Request) -> httpx.Response:
            arrived.set()
            await release.wait()  # the prefill: nothing comes back yet
            return ok()

        async with httpx.AsyncClient(transport=httpx.MockTransport(pod)) as client:
            first = router.route("/v1/completions", body())
            task = asyncio.create_task(send(client, router, first))
            await arrived.wait()
            second = router.route("/v1/completions", body())
            release.set()
            await task
        return first, second

    first, second = asyncio.run(scenario())
    chosen = first.order[0].pod
    assert second.matched[chosen] == 4
    assert second.order[0].pod == chosen


def test_a_pod_that_refuses_the_request_is_not_expected_to_hold_its_prompt():
    async def scenario():
        router = make_router()

        async def pod(request: httpx.Request) -> httpx.Response:
            if request.url.host == refusing:
                return httpx.Response(503, headers={"Retry-After": "1"})
            return ok()

        first = router.route("/v1/completions", body())
        refusing = first.order[0].pod
        async with httpx.AsyncClient(transport=httpx.MockTransport(pod)) as client:
            await send(client, router, first)
        return router, refusing

    router, refusing = asyncio.run(scenario())
    other = "b" if refusing == "a" else "a"
    assert router.pending.match(KEYS, ["a", "b"]) == {refusing: 0, other: 4}


def test_a_request_no_pod_takes_leaves_no_expectation():
    async def scenario():
        router = make_router()

        async def pod(request: httpx.Request) -> httpx.Response:
            return httpx.Response(503)  # not accepting requests: a pod failure

        async with httpx.AsyncClient(transport=httpx.MockTransport(pod)) as client:
            with pytest.raises(NoPodAvailable):
                await send(client, router, router.route("/v1/completions", body()))
        return router

    router = asyncio.run(scenario())
    assert router.pending.match(KEYS, ["a", "b"]) == {"a": 0, "b": 0}
