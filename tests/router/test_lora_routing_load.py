"""Dynamic adapter loading by the router, over stand-in LoRA pods (real HTTP servers): an
adapter no pod holds is loaded once on a pod with a free slot, a failed load moves on to the
next pod, and a hot adapter spreads to a free pod when every holder is busy."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

from epdserve.common import metrics_text
from epdserve.router.lora import AdapterPolicy

sys.path.insert(0, str(Path(__file__).parent))
from lora_pods import make_router, scrape, send  # noqa: E402

POLICY = AdapterPolicy(sources={"sql": "/a/sql"}, dynamic=True, spread_load=4.0)
SQL = {"model": "sql", "prompt": "select"}


def run(coro_fn, router):
    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            await scrape(client, router)
            return await coro_fn(client)

    try:
        return asyncio.run(main())
    finally:
        router.close()


def counted(router, name: str, **labels: str) -> float:
    return metrics_text.total(router.metrics.render().decode(), name, **labels)


def test_an_adapter_no_pod_holds_is_loaded_once_for_concurrent_requests(lora_pods):
    a = lora_pods("a", ["chat"], max_lora=2)  # one slot left
    b = lora_pods("b", [], max_lora=2)  # two free: the adapter goes here
    b.load_gate.clear()  # the load waits until every request waits on it
    router = make_router([a, b], POLICY)

    async def requests(client):
        tasks = [asyncio.create_task(send(client, router, SQL)) for _ in range(8)]
        for _ in range(1000):  # no sleep-based assertion: just wait for the waiters
            if router.adapter_loads.waiters.get(("b", "sql"), 0) == 8:
                break
            await asyncio.sleep(0.01)
        waiting = router.adapter_loads.waiters.get(("b", "sql"), 0)
        b.load_gate.set()
        answers = await asyncio.gather(*tasks)
        return waiting, answers, await send(client, router, SQL)

    waiting, answers, after = run(requests, router)
    assert waiting == 8
    assert b.loads == [{"lora_name": "sql", "lora_path": "/a/sql"}] and a.loads == []
    assert [(s, body["pod"], body["model"]) for s, body in answers] == [(200, "b", "sql")] * 8
    assert after[1]["pod"] == "b" and len(b.loads) == 1  # a holder now: no second load
    loads = "epdserve_router:lora_loads_total"
    assert counted(router, loads, lora_name="sql", outcome="loaded") == 1
    assert counted(router, "epdserve_router:lora_requests_total", lora_name="sql") == 9
    routed = "epdserve_router:requests_total"
    assert counted(router, routed, pod="b", reason="lora_loaded") == 8


def test_a_failed_load_moves_on_to_the_next_pod(lora_pods):
    a = lora_pods("a", [], max_lora=2, running=2)  # busier: the second choice
    b = lora_pods("b", [], max_lora=2)
    b.load_error = (400, "lora_path: rank 64 is above --max-lora-rank 16")
    router = make_router([a, b], POLICY)

    async def request(client):
        return await send(client, router, SQL)

    status, body = run(request, router)
    assert (status, body["pod"]) == (200, "a")
    assert len(b.loads) == 1 and len(a.loads) == 1
    loads = "epdserve_router:lora_loads_total"
    assert counted(router, loads, lora_name="sql", outcome="failed") == 1
    assert counted(router, loads, lora_name="sql", outcome="loaded") == 1


def test_when_every_load_fails_the_client_gets_an_openai_error_naming_each_pod(lora_pods):
    a, b = lora_pods("a", [], max_lora=2), lora_pods("b", [], max_lora=2)
    a.load_error = (400, "adapter_config.json: missing")
    b.load_error = (400, "target module lm_head: the model has none")
    router = make_router([a, b], POLICY)

    async def requests(client):
        return await send(client, router, SQL), await send(client, router, SQL)

    (status, body), (again, _) = run(requests, router)
    error = body["error"]
    assert status == 502 and error["type"] == "BadGatewayError" and error["code"] == 502
    assert "adapter_config.json: missing" in error["message"]
    assert "lm_head" in error["message"] and "`sql`" in error["message"]
    # the same pods are not asked again at once: the second request fails without a load
    assert again == 502 and len(a.loads) == 1 and len(b.loads) == 1
    assert a.bodies == [] and b.bodies == []


def test_an_adapter_without_a_source_is_not_loaded(lora_pods):
    a = lora_pods("a", [], max_lora=2)
    router = make_router([a], POLICY)

    async def request(client):
        return await send(client, router, {"model": "chat", "prompt": "x"})

    status, body = run(request, router)
    assert status == 404 and a.loads == [] and a.bodies == []


def test_a_hot_adapter_spreads_to_a_pod_with_a_free_slot(lora_pods):
    a = lora_pods("a", ["sql"], max_lora=2)
    b = lora_pods("b", [], max_lora=2)
    c = lora_pods("c", ["x", "y"], max_lora=2)  # full: never a spread target
    router = make_router([a, b, c], POLICY)

    async def requests(client):
        cool = await send(client, router, SQL)  # a is not busy: no spread
        a.running = 5
        await scrape(client, router)
        hot = await send(client, router, SQL)  # every holder busy: loaded on b too
        b.running = 6
        await scrape(client, router)
        hotter = await send(client, router, SQL)  # both busy, no free pod: no more loads
        return cool, hot, hotter

    cool, hot, hotter = run(requests, router)
    assert cool[1]["pod"] == "a"
    assert hot[1]["pod"] == "b" and len(b.loads) == 1
    assert hotter[1]["pod"] == "a"  # the less loaded holder
    assert a.loads == [] and c.loads == [] and len(b.loads) == 1


def test_no_spread_when_the_free_pod_is_as_busy_as_the_holders(lora_pods):
    a = lora_pods("a", ["sql"], max_lora=2, running=5)
    b = lora_pods("b", [], max_lora=2, running=7)
    router = make_router([a, b], POLICY)

    async def request(client):
        return await send(client, router, SQL)

    status, body = run(request, router)
    assert (status, body["pod"]) == (200, "a") and b.loads == []
