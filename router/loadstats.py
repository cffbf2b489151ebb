"""Scrapes each pod's ``/metrics`` for load (vLLM names) and doubles as the health check."""

from __future__ import annotations

import asyncio
import logging

import httpx

from epdserve.router.service import Router

log = logging.getLogger(__name__)

GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def parse_load(text: str) -> dict[str, float]:
    """Sum the load gauges over their label sets (one per engine) in a text exposition."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, sep, rest = line.partition("{")
        if sep:
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        field = GAUGES.get(name.strip())
        if field is None:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        totals[field] = totals.get(field, 0.0) + value
    if "kv_usage" in totals:  # several engines: report the mean usage, not the sum
        engines = sum(1 for ln in text.splitlines() if ln.startswith("vllm:kv_cache_usage_perc"))
        totals["kv_usage"] /= max(1, engines)
    return totals


async def scrape_once(client: httpx.AsyncClient, router: Router, timeout: float) -> None:
    """Scrape every known pod concurrently; failures mark pods unhealthy."""
    await asyncio.gather(*(_scrape(client, router, p.name, timeout) for p in router.pods()))


async def _scrape(client: httpx.AsyncClient, router: Router, name: str, timeout: float) -> None:
    state = router.pod(name)
    if state is None:
        return
    try:
        response = await client.get(state.endpoint.url + "/metrics", timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        router.metrics.scrape_errors.labels(name).inc()
        log.debug("scrape of %s failed: %s", name, exc)
        await _set_health(router, state, False)
        return
    for field, value in parse_load(response.text).items():
        setattr(state, field, value)
    await _set_health(router, state, True)


async def _set_health(router: Router, state, healthy: bool) -> None:
    # a change starts or joins a subscriber thread: keep that off the event loop
    if state.healthy != healthy:
        await asyncio.to_thread(router.set_health, state.name, healthy)


async def scrape_forever(client: httpx.AsyncClient, router: Router, interval: float) -> None:
    """The background loop (cancelled at shutdown)."""
    while True:
        await scrape_once(client, router, timeout=max(0.5, interval))
        await asyncio.sleep(interval)
