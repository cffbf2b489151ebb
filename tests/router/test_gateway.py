"""The real ``epdserve router`` process in front of STAND-IN engine pods.

The pods are ``standin_pod.py`` processes (a simulated prefix cache that publishes real
KV events through our publisher), standing in for ``epdserve serve`` until it exists.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kernel",
    "tensor",
    "block",
    "cache",
    "prefix",
    "query",
    "value",
    "token",
]


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def model_dir(models):
    return models.get("llama")


@pytest.fixture(scope="module")
def pods(module_spawn, model_dir):
    return [module_spawn.standin(model_dir, num_blocks=24, block_size=16) for _ in range(3)]


def reset(pods) -> None:
    for pod in pods:
        httpx.post(pod.url + "/reset_prefix_cache", timeout=5)


def hits(spawn, pods) -> float:
    return sum(spawn.metric(p.url, "vllm:prefix_cache_hits_total") for p in pods)


def run_tenants(router_url: str, seed: int, n: int = 36) -> None:
    rng = random.Random(seed)
    tenants = [text(random.Random(t), 120) for t in range(3)]  # ~8 blocks each
    with httpx.Client(base_url=router_url, timeout=30) as client:
        for _ in range(n):
            prompt = tenants[rng.randrange(3)] + " " + text(rng, 30)
            r = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            time.sleep(0.02)  # let the pod's events reach the router


def wait_ready(url: str, pods: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(url + "/ready", timeout=2)
        if r.status_code == 200 and r.json()["pods"] == pods:
            return
        time.sleep(0.05)
    raise AssertionError("router never became ready")


@pytest.mark.slow  # the same check runs against real pods in test_serve_pods.py
def test_prefix_routing_keeps_tenants_on_the_pod_holding_their_prefix(
    module_spawn, pods, model_dir
):
    results = {}
    for strategy in ("prefix+load", "round-robin"):
        reset(pods)
        before = hits(module_spawn, pods)
        router = module_spawn.router(pods, "--model", str(model_dir), "--strategy", strategy)
        try:
            wait_ready(router.url, 3)
            run_tenants(router.url, seed=1)
            results[strategy] = hits(module_spawn, pods) - before
            if strategy == "prefix+load":
                ratio = module_spawn.metric(
                    router.url, "epdserve_router:decision_prefix_hit_ratio_sum"
                )
                assert ratio > 0
        finally:
            router.stop()
    assert results["prefix+load"] > 1.5 * results["round-robin"], results


def test_streaming_passes_through_chunk_by_chunk(module_spawn, pods, model_dir):
    router = module_spawn.router(pods, "--model", str(model_dir))
    try:
        wait_ready(router.url, 3)
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = list(r.iter_raw())
        events = b"".join(chunks).decode().split("\n\n")
        assert len(chunks) >= 5 and events[-2] == "data: [DONE]"
        assert len([e for e in events if e.startswith("data: {")]) == 5
    finally:
        router.stop()


def test_models_and_chat_are_proxied(module_spawn, pods, model_dir):
    router = module_spawn.router(pods, "--model", str(model_dir))
    try:
        wait_ready(router.url, 3)
        assert httpx.get(router.url + "/v1/models", timeout=5).json()["data"][0]["id"] == "tiny"
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi " * 40}],
            "max_tokens": 2,
        }
        r = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=10)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    finally:
        router.stop()


@pytest.mark.slow  # the same check runs against real pods in test_serve_pods.py
def test_a_killed_pod_is_dropped_and_requests_keep_succeeding(spawn, model_dir):
    pods = [spawn.standin(model_dir) for _ in range(3)]
    router = spawn.router(pods, "--model", str(model_dir), "--strategy", "round-robin")
    wait_ready(router.url, 3)
    pods[1].kill()
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for i in range(9):
            r = client.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["pod"] != int(pods[1].url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 10  # the health scrape marks it unhealthy
    while spawn.metric(router.url, "epdserve_router:pods", {"state": "unhealthy"}) != 1:
        assert time.monotonic() < deadline, "the killed pod was never marked unhealthy"
        time.sleep(0.05)
    wait_ready(router.url, 2)


def test_a_pod_answering_503_is_skipped_before_any_byte(spawn, model_dir):
    bad, good = spawn.standin(model_dir, fail_status=503), spawn.standin(model_dir)
    router = spawn.router([bad, good], "--strategy", "round-robin")
    wait_ready(router.url, 2)
    for _ in range(4):
        r = httpx.post(
            router.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1, "stream": True},
            timeout=10,
        )
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert spawn.metric(router.url, "epdserve_router:upstream_errors_total") >= 1


def test_no_reachable_pod_gives_an_openai_503(spawn, model_dir):
    pod = spawn.standin(model_dir)
    router = spawn.router([pod])
    wait_ready(router.url, 1)
    pod.kill()
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    deadline = time.monotonic() + 10
    while httpx.get(router.url + "/ready", timeout=2).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)


# --- replicas: each builds its index from the pods' events; one started (or restarted)
# later catches up through the pods' replay endpoints, so they route alike


def send(router_url: str, prompt: str) -> int:
    r = httpx.post(
        router_url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["pod"]


def tenants(seed: int, n: int = 3) -> list[str]:
    return [text(random.Random(seed * 100 + t), 120) for t in range(n)]  # ~8 blocks each


def test_a_replica_started_later_routes_prefixes_where_the_first_one_did(spawn, model_dir):
    pods = [spawn.standin(model_dir, num_blocks=64, block_size=16) for _ in range(3)]
    flags = ("--model", str(model_dir))
    first = spawn.router(pods, *flags)
    wait_ready(first.url, 3)
    rng = random.Random(5)
    homes = {}
    for prompt in tenants(1):
        homes[prompt] = send(first.url, prompt + " " + text(rng, 10))
        time.sleep(0.1)  # the pod's events reach the router
    assert len(set(homes.values())) > 1  # the tenants spread over pods
    second = spawn.router(pods, *flags)  # replays what the pods already hold
    wait_ready(second.url, 3)
    time.sleep(0.5)  # replay lands
    for prompt, home in homes.items():
        assert send(second.url, prompt + " " + text(rng, 10)) == home
        assert send(first.url, prompt + " " + text(rng, 10)) == home

    second.stop()  # a replica restarted mid-run: prefixes stored meanwhile are replayed
    later = {}
    for prompt in tenants(2):
        later[prompt] = send(first.url, prompt + " " + text(rng, 10))
        time.sleep(0.1)
    restarted = spawn.router(pods, *flags)
    wait_ready(restarted.url, 3)
    time.sleep(0.5)
    for prompt, home in {**homes, **later}.items():
        assert send(restarted.url, prompt + " " + text(rng, 10)) == home
