"""X-Request-Id is a label, never a key of engine state: 100 concurrent requests whose
headers collide at random with each other and with the ids ``n>1`` children and multi-prompt
requests would get if the header named them (``abc-0``, ``abc-p1``) are all served, each
exactly as when it runs alone, through a pod and through a router in front of it."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hostile_inputs import AUTH

LABELS = ["abc", "abc-0", "abc-1", "abc-p0", "abc-p1", "cmpl-abc", "chatcmpl-abc", "x", "x-0"]
NUM_REQUESTS = 100


def make_requests(seed: int = 7) -> list[tuple[str, dict, str | None]]:
    """(path, body, X-Request-Id or None): a mix of completions (one and two prompts),
    chats, greedy and seeded, n = 1..3."""
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        n = rng.choice([1, 1, 2, 3])
        sampling = {"max_tokens": rng.randint(3, 8), "n": n}
        sampling |= {"temperature": 1.0, "seed": 1000 + i} if n > 1 or i % 3 else {}
        sampling.setdefault("temperature", 0)
        if i % 4 == 3:
            body = {"messages": [{"role": "user", "content": f"item {i}: hello"}], **sampling}
            path = "/v1/chat/completions"
        else:
            prompt = f"def f{i}(x):" if i % 5 else [f"a{i} = ", f"b{i} = {i} +"]
            body, path = {"prompt": prompt, **sampling}, "/v1/completions"
        label = rng.choice(LABELS) if rng.random() < 0.9 else None
        requests.append((path, {"model": "tiny", **body}, label))
    return requests


def answer(url: str, path: str, body: dict, label: str | None) -> list[tuple]:
    headers = {**AUTH, **({"X-Request-Id": label} if label else {})}
    resp = httpx.post(url + path, json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, f"{label}: {resp.status_code} {resp.text[:300]}"
    if label is not None:
        assert resp.headers.get("x-request-id") == label, "the label is echoed as sent"
    choices = resp.json()["choices"]
    text = [c.get("text", (c.get("message") or {}).get("content")) for c in choices]
    return sorted((c["index"], t, c["finish_reason"]) for c, t in zip(choices, text, strict=True))


@pytest.mark.parametrize("target", ["pod", "router"])
def test_colliding_request_ids_are_all_served_as_when_alone(server, router, target):
    requests = make_requests()
    assert len({label for *_, label in requests}) > 5  # the headers do collide
    core_pid = server.core_pid()
    solo = [answer(server.url, *r) for r in requests]
    url = server.url if target == "pod" else router
    with ThreadPoolExecutor(max_workers=NUM_REQUESTS) as pool:
        together = list(pool.map(lambda r: answer(url, *r), requests))
    for i, (alone, concurrent) in enumerate(zip(solo, together, strict=True)):
        assert concurrent == alone, f"request {i} ({requests[i][2]}) differs from its solo run"
    assert server.core_pid() == core_pid
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
