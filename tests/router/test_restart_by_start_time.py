"""The health scrape sees a restart it never saw fail: vLLM's ``process_start_time_seconds``
changed between two good scrapes, so the pod's index entries go (then a fresh replay)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from epdserve.connectors.kv_events import BlockStored, EventBatch
from epdserve.router.loadstats import scrape_once
from epdserve.router.pods import PodEndpoint
from epdserve.router.reconcile import process_start
from epdserve.router.service import Router
from epdserve.router.strategy import make_strategy

VLLM_PAGE = Path("/work/shared/testdata/vllm-0.32/metrics.txt").read_text()
POD = "10.0.0.7:8000"


def router_holding_blocks() -> Router:
    router = Router(make_strategy("prefix"), None, subscribe=False)
    router.add_pod(PodEndpoint.parse(f"http://{POD}", 5557, 5558))
    stored = BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None)
    router.index.apply(POD, EventBatch(0.0, [stored]))
    assert router.index.pod_block_count(POD) == 2
    return router


def scrape(router: Router, page: str) -> None:
    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=page))
        async with httpx.AsyncClient(transport=transport) as client:
            await scrape_once(client, router, timeout=1.0)

    asyncio.run(run())


def resyncs(router: Router) -> float:
    labels = {"pod": POD, "reason": "restart"}
    return (
        router.metrics.registry.get_sample_value("epdserve_router:index_resyncs_total", labels)
        or 0.0
    )


def test_vllms_page_tells_its_process_start_time():
    assert process_start(VLLM_PAGE) == 1.79604344116e09
    assert process_start("vllm:num_requests_running 0.0\n") is None


def test_a_new_process_start_time_drops_the_pods_entries_and_keeps_it_in_rotation():
    router = router_holding_blocks()
    scrape(router, VLLM_PAGE)
    scrape(router, VLLM_PAGE)  # the same process twice: nothing happens
    assert router.index.pod_block_count(POD) == 2 and resyncs(router) == 0
    start = "process_start_time_seconds 1.79604344116e+09"
    later = VLLM_PAGE.replace(start, "process_start_time_seconds 1.7960435e+09")
    scrape(router, later)
    assert router.index.pod_block_count(POD) == 0 and resyncs(router) == 1
    assert router.pod(POD).healthy


def test_a_page_without_a_start_time_never_resubscribes():
    router = router_holding_blocks()
    page = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"
    for _ in range(3):
        scrape(router, page)
    assert router.index.pod_block_count(POD) == 2 and resyncs(router) == 0
