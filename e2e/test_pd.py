"""Scenario 2: the P/D example (operator-managed Redis) answers exactly like a colocated pod;
decode pods load prefixes from Redis and the router routes by prefix."""

from __future__ import annotations

import httpx
import pytest
from capabilities import pd_routing_gap
from cluster import wait_for
from pools_e2e import NS, example, for_this_machine, metric_total, ready_pod_ips, write

pytestmark = pytest.mark.e2e
PROMPTS = [f"def handler_{i}(request):\n    return" * 4 for i in range(4)]


def complete(base: str, served: str, prompt: str) -> dict:
    body = {"model": served, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()


def metrics(ip: str) -> str:
    return httpx.get(f"http://{ip}:8000/metrics", timeout=10).text


def test_pd_pool_answers_like_a_colocated_pod(cluster, tmp_path):
    gap = pd_routing_gap()
    if gap:
        pytest.skip(gap)
    pd = for_this_machine(example("pd-redis"), replicas={"prefill": 1, "decode": 1, "router": 1})
    name, served = pd["metadata"]["name"], pd["spec"]["model"]["name"]
    ref = for_this_machine(example("colocated-text"), replicas={"colocated": 1})
    ref["metadata"]["name"] = "pd-reference"
    ref["spec"]["model"] = pd["spec"]["model"]  # the same checkpoint, from the same PVC
    try:
        for body in (pd, ref):
            cluster.kubectl("apply", "--validate=false", "-f", write(tmp_path, body))
        for pool in (name, "pd-reference"):
            cluster.kubectl(
                "wait", f"ipool/{pool}", "--for=condition=Ready", "--timeout=240s", timeout=260
            )
        router = f"http://{cluster.service_ip(NS, name)}"
        (colocated_ip,) = ready_pod_ips(cluster, "epdserve.io/pool=pd-reference")
        for prompt in PROMPTS + PROMPTS:  # the second round reuses every prefix
            got = complete(router, served, prompt)
            want = complete(f"http://{colocated_ip}:8000", served, prompt)
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["usage"] == want["usage"]
        decode_ips = ready_pod_ips(cluster, f"epdserve.io/pool={name},epdserve.io/role=decode")
        hits = sum(
            metric_total(metrics(ip), "vllm:external_prefix_cache_hits_total") for ip in decode_ips
        )
        assert hits > 0, "decode pods loaded no prefix from Redis"
        (router_ip,) = ready_pod_ips(cluster, f"epdserve.io/router={name}")
        routed = metrics(router_ip)
        assert metric_total(routed, "epdserve_router:requests_total", reason="prefix_hit") > 0
    finally:
        for pool in (name, "pd-reference"):
            cluster.kubectl("delete", "ipool", pool, "--ignore-not-found", check=False)
        wait_for(lambda: not cluster.api.list("Pod", NS), 90, "the pools' pods to go")
