"""Processed-prompt trust in a keyed E/P/D pool of real processes (a real redis-server):
pods take only processed prompts the pool signed, a salted image gets encoder outputs of its
own, and a leg whose pod finds no encoder output for the images it was named (evicted since
the encoder leg) is sent again by the router with the images.

The encoder pod stores its outputs in a database the prefill and decode pods do not read, so
for them every image the encoder named is one the store lost."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis
from serving_support import ServerProcess
from test_encoder_disaggregation import body, data_url, offline_text, text_only
from test_router_disagg import RouterProcess, connector, endpoint

KEY = "0123456789abcdef" * 4
ENV = {"EPDSERVE_PROCESSED_PROMPT_KEY": KEY}
CHAT = "/v1/chat/completions"


def pod(model: str, role: str, kv_url: str, ec_url: str) -> ServerProcess:
    flags = ["--role", role, "--hash-seed", "s"]
    if role != "encoder":
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        flags += ["--kv-transfer-config", connector("kv", kv_role, kv_url)]
    ec_role = "ec_producer" if role == "encoder" else "ec_consumer"
    flags += ["--ec-transfer-config", connector("ec", ec_role, ec_url)]
    return ServerProcess(model, *flags, api_key=None, env=ENV)


@pytest.fixture(scope="module")
def pool(models, redis_server):
    if redis_server.proc is None:
        redis_server.start()
    base = redis_server.url.rsplit("/", 1)[0]
    # databases of this module alone, emptied first: the session's db 0 holds other modules'
    # encoder outputs of the same images (this pool's name and model are theirs)
    shared = base + "/2"  # KV blocks, and what prefill/decode read
    lost = base + "/3"  # the encoder's outputs: nobody else reads them
    for url in (shared, lost):
        redis.Redis.from_url(url).flushdb()
    model = str(models.get("gemma3"))
    pods, router = {}, None
    try:
        pods["encoder"] = pod(model, "encoder", shared, lost)
        for role in ("prefill", "decode"):
            pods[role] = pod(model, role, shared, shared)
        router = RouterProcess(
            model,
            *("--encoder-endpoint", endpoint(pods["encoder"])),
            *("--prefill-endpoint", endpoint(pods["prefill"])),
            *("--decode-endpoint", endpoint(pods["decode"])),
            env=ENV,
        )
        yield router, pods, lost
    finally:
        for process in [router, *pods.values()]:
            if process is not None:
                process.stop()


def post(url: str, payload: dict) -> httpx.Response:
    return httpx.post(url + CHAT, json=payload, timeout=60)


def encoded(pods, url: str, salt: str | None = None) -> dict:
    extra = {"cache_salt": salt} if salt else {}
    out = post(pods["encoder"].url, {**body(url), **extra})
    assert out.status_code == 200, out.text
    return out.json()


def test_a_keyed_pod_refuses_a_processed_prompt_the_pool_did_not_sign(pool):
    _, pods, _ = pool
    url = data_url((90, 10, 10))
    signed = encoded(pods, url)["processed_prompt"]
    assert len(signed["signature"]) == 64
    unsigned = {k: v for k, v in signed.items() if k != "signature"}
    forged = json.loads(json.dumps(signed))
    forged["mm_items"][0]["id"] = "f" * 64  # an image id guessed, not sent
    loads = pods["prefill"].metric("epdserve:encoder_loads_total")
    for prompt, salt, why in [
        (unsigned, None, "required"),
        (forged, None, "does not match"),
        (signed, "tenant-a", "does not match"),  # signed for no salt
    ]:
        extra = {"cache_salt": salt} if salt else {}
        resp = post(
            pods["prefill"].url, {**text_only(body(url)), "processed_prompt": prompt, **extra}
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "processed_prompt.signature" and why in error["message"]
        assert error["type"] == "BadRequestError"
    # refused before any store was asked: the answer says nothing of what it holds
    assert pods["prefill"].metric("epdserve:encoder_loads_total") == loads


def test_a_signed_prompt_naming_images_the_store_lost_gets_503_asking_for_them(pool):
    _, pods, _ = pool
    url = data_url((10, 90, 10))
    signed = encoded(pods, url)["processed_prompt"]
    resp = post(pods["prefill"].url, {**text_only(body(url)), "processed_prompt": signed})
    assert resp.status_code == 503 and resp.headers["x-epdserve-resend"] == "images"
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"


def test_a_prompt_signed_by_the_prefill_pod_is_taken_by_the_decode_pod(pool, models):
    _, pods, _ = pool
    url = data_url((10, 10, 90))
    pre = post(
        pods["prefill"].url,
        {**body(url), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    ).json()
    assert len(pre["processed_prompt"]["signature"]) == 64
    dec = post(
        pods["decode"].url,
        {
            **text_only(body(url)),
            "processed_prompt": pre["processed_prompt"],
            "kv_transfer_params": pre["kv_transfer_params"],
        },
    )
    assert dec.status_code == 200, dec.text
    assert dec.json()["choices"][0]["message"]["content"] == offline_text(models, url)


def test_a_salted_image_gets_encoder_outputs_of_its_own(pool):
    _, pods, lost = pool
    url = data_url((120, 120, 0))
    runs = pods["encoder"].metric("epdserve:encoder_runs_total")
    ids = [encoded(pods, url, salt)["ec_transfer_params"]["mm_ids"][0] for salt in (None, "a", "b")]
    assert len(set(ids)) == 3
    assert pods["encoder"].metric("epdserve:encoder_runs_total") == runs + 3
    assert encoded(pods, url, "a")["ec_transfer_params"]["mm_ids"][0] == ids[1]  # a store hit
    assert pods["encoder"].metric("epdserve:encoder_runs_total") == runs + 3
    store = redis.Redis.from_url(lost)
    try:
        for ident in ids:
            assert len(store.keys(f"*{ident}*")) == 1, ident
    finally:
        store.close()


def test_the_router_sends_the_images_again_when_the_store_lost_them(pool, models):
    router, pods, _ = pool
    url = data_url((200, 10, 30))
    runs = pods["prefill"].metric("epdserve:encoder_runs_total")
    for salt in (None, "tenant-a"):
        extra = {"cache_salt": salt} if salt else {}
        resp = post(router.url, {**body(url), **extra})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == offline_text(models, url)
    # the core's counters reach /metrics with its next stats, maybe after the answer
    deadline = time.monotonic() + 30
    while pods["prefill"].metric("epdserve:encoder_runs_total") < runs + 2:
        assert time.monotonic() < deadline, "the prefill pod did not encode both resends"
        time.sleep(0.1)
    assert pods["prefill"].metric("epdserve:encoder_runs_total") == runs + 2
    retries = [
        line
        for line in router.metrics().splitlines()
        if line.startswith("epdserve_router:upstream_retries") and "resend_images" in line
    ]
    assert retries and float(retries[0].split()[-1]) >= 2
