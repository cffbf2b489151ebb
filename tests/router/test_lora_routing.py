"""Adapter-aware routing: what the router learns of each pod's adapters, and how a request
that names an adapter is ranked (holders first, then prefix, then load), over stand-in LoRA
pods (real HTTP servers, tests/router/lora_pods.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from epdserve.common import metrics_text
from epdserve.common.cli_fields import add_fields, from_args
from epdserve.connectors.kv_events import BlockStored, EventBatch
from epdserve.router.config import RouterConfig
from epdserve.router.lora import AdapterPolicy, parse_lora_info, parse_models, parse_modules

sys.path.insert(0, str(Path(__file__).parent))
from lora_pods import LoraPod, make_router, scrape, send  # noqa: E402

BS = 4
PROMPT = list(range(100, 116))  # 4 blocks of 4


def run(coro_fn, *routers):
    async def main():
        async with httpx.AsyncClient(timeout=10) as client:
            await scrape(client, *routers)
            return await coro_fn(client)

    try:
        return asyncio.run(main())
    finally:
        for router in routers:
            router.close()


def test_the_newest_lora_info_sample_is_the_pods_state():
    pod = LoraPod("a", ["sql"], max_lora=3)
    pod.running_adapters = ["sql", "chat"]
    try:
        assert parse_lora_info(pod.metrics_page()) == (3, frozenset({"sql", "chat"}))
    finally:
        pod.close()
    assert parse_lora_info("vllm:num_requests_running 1\n") is None


def test_the_pods_list_tells_an_adapter_with_a_comma_from_two_adapters(lora_pods):
    pod = lora_pods("a", ["a,b", "c"], max_lora=4)
    pod.running_adapters = ["a,b", "c"]
    text = pod.metrics_page()  # running_lora_adapters="a,b,c", as vLLM joins them
    assert parse_lora_info(text, frozenset({"a,b", "c"})) == (4, frozenset({"a,b", "c"}))
    assert parse_lora_info(text, frozenset({"a,b,c"})) == (4, frozenset({"a,b,c"}))
    assert parse_lora_info(text, frozenset({"a", "b", "c"}))[1] == {"a", "b", "c"}
    assert parse_lora_info(text)[1] == {"a", "b", "c"}  # list not known yet: pieces


def test_a_pod_serving_a_comma_name_is_not_taken_for_a_holder_of_its_pieces(lora_pods):
    vllm, other = lora_pods("vllm", ["a,b", "c"], max_lora=4), lora_pods("other", ["a"])
    vllm.running_adapters = ["a,b", "c"]
    router = make_router([vllm, other])

    async def check(client):
        return router.pod("vllm").adapters, await send(client, router, {"model": "a"})

    view, (status, answer) = run(check, router)
    assert view.running == {"a,b", "c"} and not view.holds("a") and not view.holds("b")
    assert (status, answer["pod"]) == (200, "other")


def test_the_model_list_names_the_base_and_the_adapters():
    pod = LoraPod("a", ["sql", "chat"])
    try:
        assert parse_models(pod.model_list()) == ("tiny", frozenset({"sql", "chat"}))
    finally:
        pod.close()
    with pytest.raises(ValueError):
        parse_models({"object": "list"})


def test_the_router_learns_each_pods_adapters_and_slots(lora_pods):
    a, b = lora_pods("a", ["sql"], max_lora=4), lora_pods("b", [], max_lora=1)
    a.running_adapters = ["sql"]
    router = make_router([a, b])

    async def check(client):
        return {p.name: p.adapters for p in router.pods()}

    views = run(check, router)
    assert views["a"].listed == {"sql"} and views["a"].running == {"sql"}
    assert views["a"].max_lora == 4 and views["a"].base == "tiny"
    assert views["b"].listed == frozenset() and views["b"].has_free_slot()
    assert not views["a"].holds("chat")


def test_a_request_for_an_adapter_goes_to_the_pods_holding_it(lora_pods):
    # b is idle and a busy, but only a holds the adapter; the base model goes by load
    a, b = lora_pods("a", ["sql"], running=3), lora_pods("b", ["chat"])
    router = make_router([a, b])

    async def requests(client):
        return [
            await send(client, router, {"model": "sql", "prompt": "x"}),
            await send(client, router, {"model": "chat", "prompt": "x"}),
            await send(client, router, {"model": "tiny", "prompt": "x"}),
        ]

    (s1, sql), (s2, chat), (s3, base) = run(requests, router)
    assert (s1, sql["pod"], sql["model"]) == (200, "a", "sql")
    assert (s2, chat["pod"]) == (200, "b")
    assert (s3, base["pod"]) == (200, "b")
    assert routed(router, "sql") == 1


def test_an_adapter_no_pod_holds_gets_404_without_dynamic_loading(lora_pods):
    a = lora_pods("a", ["sql"])
    policy = AdapterPolicy(sources={"chat": "/a/chat"})  # a source, but loading is off
    router = make_router([a], policy)

    async def request(client):
        return await send(client, router, {"model": "chat", "prompt": "x"})

    status, body = run(request, router)
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    assert body["error"]["param"] == "model" and "`chat`" in body["error"]["message"]
    assert a.bodies == [] and a.loads == []


def test_without_a_served_name_a_listed_adapter_is_still_an_adapter(lora_pods):
    a, b = lora_pods("a", ["sql"], running=3), lora_pods("b", [])
    router = make_router([a, b], served=None)

    async def request(client):
        return router._lora({"model": "sql"}), router._lora({"model": "tiny"})

    assert run(request, router) == ("sql", None)


def routed(router, lora: str) -> float:
    page = router.metrics.render().decode()
    return metrics_text.total(page, "epdserve_router:lora_requests_total", lora_name=lora)


def stored(pod_router, pod: str, lora: str | None, hashes) -> None:
    blocks = [PROMPT[i * BS : (i + 1) * BS] for i in range(len(hashes))]
    tokens = [t for block in blocks for t in block]
    event = BlockStored(list(hashes), None, tokens, BS, 1 if lora else None, "GPU", lora, None, 0)
    pod_router.index.apply(pod, EventBatch(0.0, [event], 0))


def test_prefix_hits_count_only_within_the_adapter(lora_pods):
    # a caches the prompt for the base model, b for the adapter; both hold the adapter
    a, b = lora_pods("a", ["sql"]), lora_pods("b", ["sql"])
    router = make_router([a, b])
    stored(router, "a", None, [11, 12, 13])
    stored(router, "b", "sql", [21, 22])
    processed = {"processed_prompt": {"prompt_token_ids": PROMPT}}

    async def requests(client):
        sql = router.route("/v1/completions", {"model": "sql", **processed})
        base = router.route("/v1/completions", {"model": "tiny", **processed})
        return sql, base, await send(client, router, {"model": "sql", **processed})

    sql, base, (_, answer) = run(requests, router)
    assert sql.lora == "sql" and sql.matched == {"a": 0, "b": 2}
    assert base.lora is None and base.matched == {"a": 3, "b": 0}
    assert answer["pod"] == "b" and base.order[0].pod == "a"


def test_a_pod_that_no_longer_lists_the_adapter_gets_none_of_its_requests(lora_pods):
    # b has the longest prefix for the adapter's blocks, but it unloaded the adapter
    a, b = lora_pods("a", ["sql"]), lora_pods("b", [])
    router = make_router([a, b])
    stored(router, "b", "sql", [21, 22, 23])

    async def request(client):
        body = {"model": "sql", "processed_prompt": {"prompt_token_ids": PROMPT}}
        return await send(client, router, body)

    status, answer = run(request, router)
    assert (status, answer["pod"]) == (200, "a")


def test_lora_flags_and_their_environment_make_the_policy():
    import argparse

    parser = argparse.ArgumentParser()
    env = {"EPDSERVE_LORA_MODULES": "sql=/a/sql chat=/a/chat", "EPDSERVE_DYNAMIC_LORA": "true"}
    add_fields(parser, RouterConfig, env)
    config = from_args(RouterConfig, parser.parse_args(["--endpoint", "http://h:1"]))
    policy = config.adapter_policy()
    assert policy.sources == {"sql": "/a/sql", "chat": "/a/chat"} and policy.dynamic
    assert parse_modules(['{"name": "x", "path": "/p", "base_model_name": "tiny"}']) == {"x": "/p"}
    for bad in (["sql"], ["sql=/a", "sql=/b"], ['{"name": "x"}'], ["a,b=/a/ab"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            RouterConfig(endpoint=["http://h:1"], lora_modules=bad)
    assert not RouterConfig(endpoint=["http://h:1"]).adapter_policy().configured
