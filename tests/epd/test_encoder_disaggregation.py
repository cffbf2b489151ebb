"""E -> P -> D through real processes, over a real redis-server and over a shared directory:
same tokens as one pod, and the prefill/decode pods never run the vision encoder for images
the encoder stored."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from serving_support import ServerProcess


def data_url(color) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (80, 50), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(url: str, text: str = "what is in the picture " * 3) -> dict:
    return {
        "model": "tiny",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": text},
                ],
            }
        ],
    }


BACKENDS = {  # (encoder-cache connector, KV connector, what their extra config names)
    "redis": ("RedisECConnector", "RedisConnector", "url"),
    "shared": ("SharedStorageECConnector", "SharedStorageConnector", "path"),
}


# shared storage in the slow tier (~30 s of pods): its stores pass tests/connectors' conformance
@pytest.fixture(scope="module", params=["redis", pytest.param("shared", marks=pytest.mark.slow)])
def pods(request, models, tmp_path_factory):
    ec_name, kv_name, key = BACKENDS[request.param]
    if key == "url":
        where = request.getfixturevalue("redis_server").url
    else:
        where = str(tmp_path_factory.mktemp("shared") / "cache")

    def ec(role):
        return json.dumps(
            {"ec_connector": ec_name, "ec_role": role, "ec_connector_extra_config": {key: where}}
        )

    def kv(role):
        return json.dumps(
            {"kv_connector": kv_name, "kv_role": role, "kv_connector_extra_config": {key: where}}
        )

    model = str(models.get("gemma3"))
    common = ("--hash-seed", "pool-seed")
    started = []
    try:
        started.append(
            ServerProcess(
                model,
                "--role",
                "encoder",
                "--ec-transfer-config",
                ec("ec_producer"),
                *common,
                api_key=None,
            )
        )
        started.append(
            ServerProcess(
                model,
                "--role",
                "prefill",
                "--kv-transfer-config",
                kv("kv_producer"),
                "--ec-transfer-config",
                ec("ec_consumer"),
                *common,
                api_key=None,
            )
        )
        started.append(
            ServerProcess(
                model,
                "--role",
                "decode",
                "--kv-transfer-config",
                kv("kv_consumer"),
                "--ec-transfer-config",
                ec("ec_consumer"),
                *common,
                api_key=None,
            )
        )
        yield started
    finally:
        for srv in started:
            srv.stop()


def offline_text(models, url: str) -> str:
    from epdserve.engine import LLM, SamplingParams

    llm = LLM(model=str(models.get("gemma3")), max_model_len=512)
    req = body(url)
    return llm.chat(req["messages"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text


def test_encoder_then_prefill_then_decode_equals_one_pod(pods, models):
    encoder, prefill, decode = pods
    url = data_url((200, 10, 30))
    enc = httpx.post(encoder.url + "/v1/chat/completions", json=body(url), timeout=60).json()
    assert len(enc["ec_transfer_params"]["mm_ids"]) == 1
    assert encoder.metric("epdserve:encoder_runs_total") == 1
    pre = httpx.post(
        prefill.url + "/v1/chat/completions",
        timeout=60,
        json={**body(url), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    ).json()
    params = pre["kv_transfer_params"]
    assert params and params["num_tokens"] > 16
    dec = httpx.post(
        decode.url + "/v1/chat/completions",
        timeout=60,
        json={**body(url), "kv_transfer_params": params},
    ).json()
    assert dec["choices"][0]["message"]["content"] == offline_text(models, url)
    assert prefill.metric("epdserve:encoder_runs_total") == 0
    assert prefill.metric("epdserve:encoder_loads_total") == 1
    assert decode.metric("epdserve:encoder_runs_total") == 0
    assert decode.metric("vllm:external_prefix_cache_hits_total") >= 16


def test_an_image_the_encoder_never_saw_is_encoded_locally(pods, models):
    _, prefill, _ = pods
    url = data_url((5, 5, 250))
    before = prefill.metric("epdserve:encoder_runs_total")
    out = httpx.post(prefill.url + "/v1/chat/completions", json=body(url), timeout=60).json()
    assert out["choices"][0]["message"]["content"] == offline_text(models, url)
    assert prefill.metric("epdserve:encoder_runs_total") == before + 1


def test_an_encoder_pod_refuses_text_only_requests(pods):
    encoder = pods[0]
    resp = httpx.post(
        encoder.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def text_only(req: dict) -> dict:
    from epdserve.common.chat_parts import without_images

    return {**req, "messages": without_images(req["messages"])}


def test_the_prompt_is_processed_once_and_pixels_reach_only_the_encoder(pods, models):
    encoder, prefill, decode = pods
    url = data_url((20, 200, 30))
    sent = [p.metric("epdserve:core_input_bytes_total") for p in pods]
    enc = httpx.post(encoder.url + "/v1/chat/completions", json=body(url), timeout=60).json()
    processed = enc["processed_prompt"]
    assert [i["id"] for i in processed["mm_items"]] == enc["ec_transfer_params"]["mm_ids"]
    pre = httpx.post(
        prefill.url + "/v1/chat/completions",
        timeout=60,
        json={
            **text_only(body(url)),
            "processed_prompt": processed,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    ).json()
    assert pre["processed_prompt"] == processed
    dec = httpx.post(
        decode.url + "/v1/chat/completions",
        timeout=60,
        json={
            **text_only(body(url)),
            "processed_prompt": processed,
            "kv_transfer_params": pre["kv_transfer_params"],
        },
    ).json()
    assert dec["choices"][0]["message"]["content"] == offline_text(models, url)
    grew = [
        p.metric("epdserve:core_input_bytes_total") - s for p, s in zip(pods, sent, strict=True)
    ]
    pixels = 3 * 64 * 64 * 4  # the tiny Gemma3's processed image, float32
    assert grew[0] > pixels and grew[1] < pixels / 8 and grew[2] < pixels / 8


def test_a_processed_prompt_naming_an_image_no_store_has_fails_alone(pods):
    _, prefill, _ = pods
    url = data_url((1, 2, 3))
    enc = httpx.post(pods[0].url + "/v1/chat/completions", json=body(url), timeout=60).json()
    forged = json.loads(json.dumps(enc["processed_prompt"]))
    forged["mm_items"][0]["id"] = "f" * 64
    resp = httpx.post(
        prefill.url + "/v1/chat/completions",
        json={**text_only(body(url)), "processed_prompt": forged},
        timeout=60,
    )
    # 503 asking for the images (the router sends the leg again with them), OpenAI's shape
    assert resp.status_code == 503 and "never got its pixels" in resp.json()["error"]["message"]
    assert resp.headers["retry-after"] == "1" and resp.headers["x-epdserve-resend"] == "images"
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    bad = {**forged, "mm_items": [{**forged["mm_items"][0], "offset": 0}]}
    resp = httpx.post(
        prefill.url + "/v1/chat/completions",
        json={**text_only(body(url)), "processed_prompt": bad},
        timeout=60,
    )
    assert (
        resp.status_code == 400 and "processed_prompt.mm_items" in resp.json()["error"]["message"]
    )
    ok = httpx.post(prefill.url + "/v1/chat/completions", json=body(url), timeout=60)
    assert ok.status_code == 200
