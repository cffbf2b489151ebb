"""Router replicas agree: each builds its index from the pods' events, and one started (or
restarted) later catches up through the pods' replay endpoints, so the same prefixed
request goes to the same pod whichever replica receives it."""

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


def wait_ready(url: str, pods: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(url + "/ready", timeout=2)
        if r.status_code == 200 and r.json()["pods"] == pods:
            return
        time.sleep(0.05)
    raise AssertionError("router never became ready")


@pytest.fixture(scope="module")
def model_dir(models):
    return models.get("llama")


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
