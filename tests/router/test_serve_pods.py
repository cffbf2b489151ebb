"""The router in front of three real ``epdserve serve`` pods with KV events on.

Tiny model, small KV caches (``--kv-cache-memory``), so tenants that share a long prefix
evict each other under round-robin but stay cached under prefix routing. Hits are read
from the pods' own ``vllm:prefix_cache_hits`` counters.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from epdserve.common import metrics_text

# tiny llama, fp32: layers x (K, V) x block_size x kv_heads x head_dim x 4 bytes
BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4
# 18 blocks per pod: one tenant's 12-block prefix + suffix fits, two do not
POD_FLAGS = ("--max-model-len", "256", "--kv-cache-memory", str(18 * BLOCK_BYTES))


@pytest.fixture(scope="module")
def model_dir(models):
    return models.get("llama")


@pytest.fixture(scope="module")
def pods(module_spawn, model_dir):
    started = [module_spawn.serve(model_dir, *POD_FLAGS) for _ in range(3)]
    for pod in started:
        module_spawn.wait_ready(pod)
    return started


def hits(spawn, pods) -> float:
    return sum(
        spawn.metric(p.url, "vllm:prefix_cache_hits_total") for p in pods if p.proc.poll() is None
    )


def wait_router(url: str, pods: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(url + "/ready", timeout=2)
        if r.status_code == 200 and r.json()["pods"] == pods:
            return
        time.sleep(0.05)
    raise AssertionError("router never became ready")


def run_tenants(url: str, seed: int, n: int = 30) -> None:
    """Three tenants with 200-token prefixes (token-id prompts, fresh per seed so no run
    reuses another's cache) and 12-token private suffixes."""
    rng = random.Random(seed)
    tenants = [
        [random.Random(seed * 10 + t).randrange(10, 4000) for _ in range(200)] for t in range(3)
    ]
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(n):
            prompt = tenants[rng.randrange(3)] + [rng.randrange(10, 4000) for _ in range(12)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            seen = events_seen(url)
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            # each request stores at least its suffix block: wait for that step's events
            deadline = time.monotonic() + 3
            while events_seen(url) == seen and time.monotonic() < deadline:
                time.sleep(0.02)


def events_seen(router_url: str) -> float:
    """Events the router applied plus batches it rejected (either way: it has seen them)."""
    samples = metrics_text.parse(httpx.get(router_url + "/metrics", timeout=5).text)
    return metrics_text.total(samples, "epdserve_router:kv_events_received_total") + (
        metrics_text.total(samples, "epdserve_router:kv_event_batches_invalid_total")
    )


def test_prefix_routing_sends_shared_prefixes_to_the_pod_holding_them(
    module_spawn, pods, model_dir
):
    got = {}
    for seed, strategy in enumerate(("prefix", "round-robin")):
        before = hits(module_spawn, pods)
        flags = ("--model", str(model_dir), "--strategy", strategy, "--speculative-ttl", "0")
        router = module_spawn.router(pods, *flags)
        try:
            wait_router(router.url, 3)
            run_tenants(router.url, seed)
            got[strategy] = hits(module_spawn, pods) - before
            events = module_spawn.metric(router.url, "epdserve_router:kv_events_received_total")
        finally:
            router.stop()
        if strategy == "prefix" and events == 0:
            pytest.skip(
                "epdserve serve publishes no KV events yet (engine must call the publisher)"
            )
    ideal = (30 - 3) * 12 * 16  # every request after each tenant's first hits 12 prefix blocks
    assert got["prefix"] >= 0.9 * ideal, got
    assert got["round-robin"] < 0.75 * got["prefix"], got


def test_killing_a_pod_mid_run_loses_no_request(module_spawn, pods, model_dir):
    """Requests in flight on the killed pod had no byte yet (non-streamed): the router
    retries them elsewhere, so every client gets a 200."""
    router = module_spawn.router(pods, "--model", str(model_dir), "--strategy", "round-robin")
    victim = pods[2]
    victim_name = victim.url.removeprefix("http://")

    def post(i: int) -> httpx.Response:
        body = {
            "model": "tiny",
            "prompt": f"request number {i}",
            "max_tokens": 160,  # long enough that the victim is seen busy, then killed busy
            "ignore_eos": True,
        }
        return httpx.post(router.url + "/v1/completions", json=body, timeout=120)

    try:
        wait_router(router.url, 3)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, i) for i in range(12)]
            deadline = time.monotonic() + 30
            while (
                module_spawn.metric(
                    router.url, "epdserve_router:inflight_requests", {"pod": victim_name}
                )
                < 1
            ):
                assert time.monotonic() < deadline, "no request ever reached the victim"
                time.sleep(0.02)
            victim.kill()
            responses = [f.result() for f in futures]
        assert [r.status_code for r in responses] == [200] * 12, [r.text for r in responses]
        deadline = time.monotonic() + 10  # the health scrape drops it from rotation
        while module_spawn.metric(router.url, "epdserve_router:pods", {"state": "unhealthy"}) != 1:
            assert time.monotonic() < deadline, "the killed pod was never marked unhealthy"
            time.sleep(0.05)
        wait_router(router.url, 2)
        retried = module_spawn.metric(
            router.url, "epdserve_router:requests_total", {"reason": "retry"}
        )
        assert retried >= 1
    finally:
        router.stop()
