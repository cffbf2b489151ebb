"""The /metrics scrape as a health check: a busy pod (slow answers, or 503 with Retry-After at
its connection limit) stays in rotation; a pod that refuses connections leaves at once."""

from __future__ import annotations

import asyncio

import httpx

from epdserve.router.loadstats import SCRAPE_TIMEOUTS_TO_UNHEALTHY, scrape_once
from epdserve.router.pods import PodEndpoint
from epdserve.router.service import Router
from epdserve.router.strategy import make_strategy

PAGE = "vllm:num_requests_running 2.0\nvllm:num_requests_waiting 1.0\n"


def router_with(*names: str) -> Router:
    router = Router(make_strategy("least-load"), None, subscribe=False)
    for name in names:
        router.add_pod(PodEndpoint.parse(f"http://{name}", 5557, 5558))
    return router


def scrape(router: Router, answer) -> None:
    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await scrape_once(client, router, timeout=1.0)

    asyncio.run(run())


def test_a_pod_that_times_out_leaves_rotation_only_after_several_scrapes_in_a_row():
    router = router_with("10.0.0.1:8000")
    pod = router.pod("10.0.0.1:8000")

    def slow(request):
        raise httpx.ReadTimeout("busy", request=request)

    for _ in range(SCRAPE_TIMEOUTS_TO_UNHEALTHY - 1):
        scrape(router, slow)
        assert pod.healthy
    scrape(router, lambda request: httpx.Response(200, text=PAGE))  # answered: count resets
    assert pod.healthy and (pod.running, pod.waiting) == (2.0, 1.0)
    for _ in range(SCRAPE_TIMEOUTS_TO_UNHEALTHY):
        scrape(router, slow)
    assert not pod.healthy
    scrape(router, lambda request: httpx.Response(200, text=PAGE))
    assert pod.healthy


def test_a_refused_connection_takes_the_pod_out_at_once():
    router = router_with("10.0.0.2:8000")

    def refused(request):
        raise httpx.ConnectError("refused", request=request)

    scrape(router, refused)
    assert not router.pod("10.0.0.2:8000").healthy


def test_a_pod_at_its_connection_limit_is_busy_not_unhealthy():
    """Past --limit-concurrency a pod answers every route 503 with Retry-After: a rest for
    that long, as for a generation request; a 503 without it is a failure."""
    router = router_with("10.0.0.3:8000", "10.0.0.4:8000")
    limited, broken = router.pod("10.0.0.3:8000"), router.pod("10.0.0.4:8000")

    def answer(request):
        retry = {"Retry-After": "1"} if request.url.host == "10.0.0.3" else {}
        return httpx.Response(503, json={"error": {"code": 503}}, headers=retry)

    scrape(router, answer)
    assert limited.healthy and limited.down_until > 0 and limited.consecutive_failures == 0
    assert not broken.healthy
