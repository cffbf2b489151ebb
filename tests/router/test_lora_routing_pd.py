"""Adapters across a P/D pool (both legs ranked for the adapter, the same ``model`` on both),
and the real ``epdserve router`` process with its LoRA flags, answering the official
``openai`` client over stand-in LoRA pods."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from epdserve.router.app import ProxySettings
from epdserve.router.disagg import DisaggRouters, handle
from epdserve.router.lora import AdapterPolicy

sys.path.insert(0, str(Path(__file__).parent))
from lora_pods import make_router, scrape  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SQL = {"model": "sql", "prompt": "select", "max_tokens": 4}


def serve_pd(prefills, decodes, policy=None) -> tuple[int, dict]:
    routers = DisaggRouters(make_router(prefills, policy), make_router(decodes, policy))

    async def main():
        async with httpx.AsyncClient(timeout=10) as client:
            await scrape(client, *routers.routers())
            response = await handle(
                client, routers, ProxySettings(), "/v1/completions", dict(SQL), {}
            )
            if hasattr(response, "body_iterator"):
                body = b"".join([chunk async for chunk in response.body_iterator])
            else:
                body = response.body
            return response.status_code, json.loads(body)

    try:
        return asyncio.run(main())
    finally:
        routers.close()


def test_prefill_and_decode_legs_both_go_to_pods_holding_the_adapter(lora_pods):
    # the idle pod of each role lacks the adapter: each leg goes to its holder
    p0, p1 = lora_pods("p0", ["sql"], running=3), lora_pods("p1", [])
    d0, d1 = lora_pods("d0", []), lora_pods("d1", ["sql"], running=3)
    status, answer = serve_pd([p0, p1], [d0, d1])
    assert (status, answer["pod"], answer["model"]) == (200, "d1", "sql")
    [(_, prefill)] = p0.bodies
    [(_, decode)] = d1.bodies
    assert prefill["model"] == decode["model"] == "sql" and prefill["max_tokens"] == 1
    assert decode["kv_transfer_params"]["from"] == "p0"
    assert p1.bodies == [] and d0.bodies == []


def test_a_decode_role_without_the_adapter_loads_it_for_the_decode_leg(lora_pods):
    p0 = lora_pods("p0", ["sql"])
    d0, d1 = lora_pods("d0", ["x"], max_lora=2), lora_pods("d1", [], max_lora=2)
    policy = AdapterPolicy(sources={"sql": "/a/sql"}, dynamic=True)
    status, answer = serve_pd([p0], [d0, d1], policy)
    assert (status, answer["pod"], answer["model"]) == (200, "d1", "sql")
    assert d1.loads == [{"lora_name": "sql", "lora_path": "/a/sql"}] and d0.loads == []
    assert p0.loads == [] and p0.bodies[0][1]["model"] == "sql"


def test_an_adapter_no_prefill_pod_holds_gets_the_pods_404(lora_pods):
    p0, d0 = lora_pods("p0", []), lora_pods("d0", ["sql"])
    status, answer = serve_pd([p0], [d0])
    assert status == 404 and answer["error"]["type"] == "NotFoundError"
    assert p0.bodies == [] and d0.bodies == []


def test_the_router_process_loads_an_adapter_for_the_openai_client(lora_pods, spawn):
    a, b = lora_pods("a", [], max_lora=2), lora_pods("b", [], max_lora=2)
    standins = [
        SimpleNamespace(url=p.url, extra={"events": free_port(), "replay": free_port()})
        for p in (a, b)
    ]
    router = spawn.router(
        standins,
        "--served-model-name",
        "tiny",
        "--lora-modules",
        "sql=/a/sql",
        "--dynamic-lora",
        "--lora-models-interval",
        "0.2",
    )
    deadline = time.monotonic() + 30  # until the router has read every pod's list
    while min(a.list_calls, b.list_calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    # the pool's models: the base, then the adapter the router may load (no pod has it yet)
    assert [m.id for m in client.models.list()] == ["tiny", "sql"]
    first = client.completions.create(model="sql", prompt="select", max_tokens=4)
    second = client.completions.create(model="sql", prompt="select", max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="select", max_tokens=4)
    loaded = [p for p in (a, b) if p.loads]
    assert len(loaded) == 1 and len(loaded[0].loads) == 1
    assert first.model == second.model == "sql"
    assert first.choices[0].text == second.choices[0].text == loaded[0].name
    assert spawn.metric(router.url, "epdserve_router:lora_loads_total", {"outcome": "loaded"}) == 1
    assert (
        spawn.metric(router.url, "epdserve_router:lora_requests_total", {"lora_name": "sql"}) == 2
    )
