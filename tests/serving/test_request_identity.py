"""X-Request-Id is a label: the engine's ids are the server's own. A request with ``n=2``
labelled ``abc`` and, while it runs, one labelled ``abc-0`` (its first child's id, had the
label been the id) are both answered, and the engine core lives on."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from serving_support import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 300, "ignore_eos": True}


def post(server, body: dict, label: str | None) -> httpx.Response:
    headers = {**AUTH, **({"X-Request-Id": label} if label else {})}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120)


def wait_admitted(server, sequences: int) -> None:
    deadline = time.monotonic() + 60
    while server.metric("epdserve:admitted_sequences") < sequences:
        assert time.monotonic() < deadline, "the first request never got in"
        time.sleep(0.02)


def test_a_label_naming_a_running_requests_child_is_served_and_the_core_lives(server):
    core_pid = server.core_pid()
    with ThreadPoolExecutor(2) as pool:
        parent = pool.submit(post, server, {**LONG, "n": 2, "temperature": 1, "seed": 5}, "abc")
        wait_admitted(server, 2)
        child = pool.submit(post, server, {**LONG, "max_tokens": 4, "temperature": 0}, "abc-0")
        answers = parent.result(), child.result()
    for r, label in zip(answers, ("abc", "abc-0"), strict=True):
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == label
        assert r.json()["id"] != label and label not in r.json()["id"]
    assert len(answers[0].json()["choices"]) == 2
    assert server.core_pid() == core_pid
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_two_requests_in_flight_with_one_label_are_both_served(server):
    body = {**LONG, "temperature": 0}  # long enough to be seen in flight on a busy machine
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, server, body, "same")
        wait_admitted(server, 1)
        second = pool.submit(post, server, body, "same")
        a, b = first.result(), second.result()
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert a.json()["id"] != b.json()["id"]


def test_without_a_label_the_response_names_the_servers_id(server):
    r = post(server, {**LONG, "max_tokens": 2}, None)
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
    assert r.json()["id"].startswith("cmpl-")


def test_a_label_with_a_space_is_refused_in_openais_shape(server):
    r = post(server, {**LONG, "max_tokens": 2}, "a b")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "X-Request-Id" and r.json()["error"]["code"] == 400
