"""Scrapes each pod's ``/metrics`` for load (vLLM names) and doubles as the health check."""

from __future__ import annotations

import asyncio
import logging

import httpx

from epdserve.common import metrics_text
from epdserve.router.lora_route import observe
from epdserve.router.proxy import REFUSED_STATUS, retry_after
from epdserve.router.reconcile import restarted, resubscribe
from epdserve.router.service import Router

log = logging.getLogger(__name__)

SCRAPE_TIMEOUTS_TO_UNHEALTHY = 3
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def parse_load(text: str) -> dict[str, float]:
    """The load gauges of a page, summed over their label sets (one per engine); KV-cache
    usage is their mean. Raises ``ValueError`` on a malformed page or one without them."""
    samples = metrics_text.parse(text, only=GAUGES)  # the gauges' lines only: cheap
    load: dict[str, float] = {}
    for name, field in GAUGES.items():
        if found := metrics_text.values(samples, name):
            load[field] = sum(found) / len(found) if field == "kv_usage" else sum(found)
    if not load:  # every engine exports them from the start: this is no engine's page
        raise ValueError("the page has none of the load gauges")
    return load


async def scrape_once(client: httpx.AsyncClient, router: Router, timeout: float) -> None:
    """Scrape every known pod concurrently; failures mark pods unhealthy."""
    await asyncio.gather(*(_scrape(client, router, p.name, timeout) for p in router.pods()))


async def _scrape(client: httpx.AsyncClient, router: Router, name: str, timeout: float) -> None:
    state = router.pod(name)
    if state is None:
        return
    try:
        response = await client.get(state.endpoint.url + "/metrics", timeout=timeout)
        busy = retry_after(response.headers) if response.status_code == REFUSED_STATUS else None
        if busy is None:
            response.raise_for_status()
    except httpx.HTTPError as exc:
        router.metrics.scrape_errors.labels(name).inc()
        log.debug("scrape of %s failed: %s", name, exc)
        # a pod that answers slowly is busy, not gone: out of rotation only after a few
        # timeouts in a row; a refused or broken connection takes it out at once
        timed_out = isinstance(exc, httpx.TimeoutException)
        state.scrape_timeouts = state.scrape_timeouts + 1 if timed_out else 0
        if not timed_out or state.scrape_timeouts >= SCRAPE_TIMEOUTS_TO_UNHEALTHY:
            await _set_health(router, state, False)
        return
    state.scrape_timeouts = 0
    if busy is not None:  # at its --limit-concurrency: busy, as a generation request's 503
        router.metrics.scrape_errors.labels(name).inc()
        state.mark_busy(busy)
        return
    try:
        load = parse_load(response.text)
    except ValueError as exc:  # the pod answers, but its page cannot be read: load unknown
        router.metrics.scrape_errors.labels(name).inc()
        log.debug("metrics of %s not parsed: %s", name, exc)
        load = {}
    for field, value in load.items():
        setattr(state, field, value)
    if restarted(state, response.text) and state.healthy:  # back before a scrape failed
        await asyncio.to_thread(resubscribe, router, name)
    await _set_health(router, state, True)
    await observe(client, router, state, response.text, timeout)  # its LoRA adapters


async def _set_health(router: Router, state, healthy: bool) -> None:
    # a change starts or joins a subscriber thread: keep that off the event loop
    if state.healthy != healthy:
        await asyncio.to_thread(router.set_health, state.name, healthy)


async def scrape_forever(client: httpx.AsyncClient, router: Router, interval: float) -> None:
    """The background loop (cancelled at shutdown)."""
    while True:
        await scrape_once(client, router, timeout=max(0.5, interval))
        await asyncio.sleep(interval)
