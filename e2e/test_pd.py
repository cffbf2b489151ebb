"""Scenario 2: the P/D example (operator-managed Redis) answers exactly like a colocated pod;
decode pods load prefixes from Redis and the router routes by prefix.

The first test drives the prefill -> decode handover itself (what the router will do), so the
operator's P/D wiring (connector configs, Redis Secret and Service, hash seed) is checked
now; the second goes through the router and skips until the router has a P/D mode.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from capabilities import pd_routing_gap
from cluster import wait_for
from pools_e2e import NS, example, for_this_machine, ready_pod_ips, write

from epdserve.common import metrics_text

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~50 s: CI runs it after make test
REF = "pd-reference"
PROMPTS = [f"def handler_{i}(request):\n    return" * 4 for i in range(3)]


def complete(base: str, served: str, prompt: str, **extra) -> dict:
    body = {"model": served, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
    answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def same_counts(got: dict, want: dict) -> bool:
    """Same prompt and completion token counts (cached_tokens differ: the decode side hits)."""
    keys = ("prompt_tokens", "completion_tokens")
    return all(got["usage"][k] == want["usage"][k] for k in keys)


def metrics(ip: str) -> str:
    return httpx.get(f"http://{ip}:8000/metrics", timeout=10).text


@pytest.fixture(scope="module")
def pools(cluster, tmp_path_factory):
    """The P/D example (1 prefill, 1 decode) and a colocated pod on the same checkpoint."""
    pd = for_this_machine(example("pd-redis"), replicas={"prefill": 1, "decode": 1, "router": 1})
    ref = for_this_machine(example("colocated-text"), replicas={"colocated": 1})
    ref["metadata"]["name"] = REF
    ref["spec"]["model"] = pd["spec"]["model"]  # the same checkpoint, from the same PVC
    name = pd["metadata"]["name"]
    tmp = tmp_path_factory.mktemp("pd")
    try:
        for body in (pd, ref):
            cluster.kubectl("apply", "-f", write(tmp, body))
        for pool in (name, REF):
            cluster.kubectl(
                "wait", f"ipool/{pool}", "--for=condition=Ready", "--timeout=240s", timeout=260
            )
        yield cluster, name, pd["spec"]["model"]["name"]
    finally:
        for pool in (name, REF):
            cluster.kubectl("delete", "ipool", pool, "--ignore-not-found", check=False)
        wait_for(lambda: not cluster.api.list("Pod", NS), 90, "the pools' pods to go")


def role_ip(cluster, pool: str, role: str) -> str:
    (ip,) = ready_pod_ips(cluster, f"epdserve.io/pool={pool},epdserve.io/role={role}")
    return ip


def test_pd_pods_hand_over_through_the_managed_redis_token_for_token(pools):
    cluster, name, served = pools
    prefill = f"http://{role_ip(cluster, name, 'prefill')}:8000"
    decode_ip = role_ip(cluster, name, "decode")
    colocated = f"http://{role_ip(cluster, REF, 'colocated')}:8000"
    for prompt in PROMPTS:
        first = complete(
            prefill, served, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        params = first["kv_transfer_params"]
        assert params and params["do_remote_prefill"] is True
        got = complete(f"http://{decode_ip}:8000", served, prompt, kv_transfer_params=params)
        want = complete(colocated, served, prompt)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert same_counts(got, want)
    hits = metrics_text.total(metrics(decode_ip), "vllm:external_prefix_cache_hits_total")
    assert hits > 0, "the decode pod loaded no prefix from Redis"


def test_pd_pool_through_its_router_answers_like_a_colocated_pod(pools):
    gap = pd_routing_gap()
    if gap:
        pytest.skip(gap)
    cluster, name, served = pools
    router = f"http://{cluster.service_ip(NS, name)}"
    colocated = f"http://{role_ip(cluster, REF, 'colocated')}:8000"
    for prompt in PROMPTS + PROMPTS:  # the second round reuses every prefix
        got = complete(router, served, prompt)
        want = complete(colocated, served, prompt)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert same_counts(got, want)
    decode_ips = ready_pod_ips(cluster, f"epdserve.io/pool={name},epdserve.io/role=decode")
    hits = sum(
        metrics_text.total(metrics(ip), "vllm:external_prefix_cache_hits_total")
        for ip in decode_ips
    )
    assert hits > 0, "decode pods loaded no prefix from Redis"
    (router_ip,) = ready_pod_ips(cluster, f"epdserve.io/router={name}")
    routed = metrics(router_ip)
    assert metrics_text.total(routed, "epdserve_router:requests_total", reason="prefix_hit") > 0


def test_scaling_decode_up_adds_pods_to_routing(pools):
    gap = pd_routing_gap()
    if gap:
        pytest.skip(gap)
    cluster, name, served = pools
    patch = '{"spec": {"roles": {"decode": {"replicas": 3}}}}'
    cluster.kubectl("patch", "ipool", name, "--type=merge", "-p", patch)
    cluster.kubectl(
        "wait",
        f"ipool/{name}",
        "--for=jsonpath={.status.roles.decode.ready}=3",
        "--timeout=180s",
        timeout=200,
    )
    decode_ips = ready_pod_ips(cluster, f"epdserve.io/pool={name},epdserve.io/role=decode")
    assert len(decode_ips) == 3
    router = f"http://{cluster.service_ip(NS, name)}"

    def every_decode_pod_generated() -> bool:
        threads = [
            threading.Thread(target=complete, args=(router, served, f"scale {time.time()} {i}"))
            for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return all(
            metrics_text.total(metrics(ip), "vllm:generation_tokens_total") > 0 for ip in decode_ips
        )

    wait_for(every_decode_pod_generated, 120, "answers from every decode pod", interval=0)
