"""One request's failure or one client's departure costs nothing to anyone else."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from serving_support import ServerProcess

PROMPTS = [f"def f{i}(x):\n    return x * {i} + " + "y" * (i % 7) for i in range(12)]


@pytest.fixture(scope="module")
def faulty(models):
    """A pod whose engine core raises for any batch holding a request named ``*poison*``."""
    srv = ServerProcess(
        str(models.get("llama")), api_key=None, env={"EPDSERVE_INJECT_FAULT": "execute:poison"}
    )
    yield srv
    srv.stop()


def body(prompt: str, **extra) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def complete(client, url, prompt, request_id=None) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return await client.post(url + "/v1/completions", json=body(prompt), headers=headers)


async def stream_text(client, url, prompt, request_id=None) -> tuple[str, dict | None]:
    headers = {"X-Request-Id": request_id} if request_id else {}
    text, error = "", None
    async with client.stream(
        "POST", url + "/v1/completions", json=body(prompt, stream=True), headers=headers
    ) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            else:
                text += event["choices"][0]["text"]
    return text, error


def idle(srv: ServerProcess, timeout: float = 20) -> None:
    """No request running or waiting, and no KV block in use."""
    deadline = time.monotonic() + timeout
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    while time.monotonic() < deadline:
        if all(srv.metric(n) == 0 for n in names):
            return
        time.sleep(0.1)
    raise AssertionError({n: srv.metric(n) for n in names})


def test_an_injected_fault_fails_its_request_alone_and_the_others_stay_exact(faulty):
    url = faulty.url
    core_pid = faulty.core_pid()

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            alone = [await complete(client, url, p) for p in PROMPTS[:6]]
            together = await asyncio.gather(
                *(complete(client, url, p) for p in PROMPTS[:6]),
                complete(client, url, PROMPTS[6], "poison-1"),
                stream_text(client, url, PROMPTS[7], "poison-2"),
            )
            return alone, together

    alone, together = asyncio.run(scenario())
    for a, b in zip(alone, together[:6], strict=True):
        assert a.status_code == b.status_code == 200
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    failed = together[6]
    assert failed.status_code == 500, failed.text
    assert "injected fault" in failed.json()["error"]["message"]
    _, stream_error = together[7]
    assert stream_error is not None and stream_error["code"] == 500
    assert faulty.core_pid() == core_pid
    assert faulty.metric("epdserve:engine_failed_steps_total") >= 1
    assert faulty.metric("epdserve:request_errors_total") >= 2
    idle(faulty)


def test_64_streams_with_a_quarter_of_clients_leaving_leave_nothing_behind(faulty):
    url = faulty.url

    async def client_run(i: int):
        async with httpx.AsyncClient(timeout=120) as client:
            payload = body(PROMPTS[i % len(PROMPTS)], stream=True, max_tokens=48)
            async with client.stream("POST", url + "/v1/completions", json=payload) as resp:
                assert resp.status_code == 200
                chunks = 0
                async for line in resp.aiter_lines():
                    chunks += line.startswith("data: ")
                    if i % 4 == 0 and chunks == 3:
                        return "left"  # closes the connection mid-stream
                return "done"

    async def scenario():
        return await asyncio.gather(*(client_run(i) for i in range(64)))

    outcomes = asyncio.run(scenario())
    assert outcomes.count("left") == 16 and outcomes.count("done") == 48
    idle(faulty)
