"""The router's P/D and E/P/D modes over real pods, a real redis-server and a real router."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from serving_support import ServerProcess, free_port, wait_ready


class RouterProcess:
    def __init__(self, model: str, *flags: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "epdserve.engine.cli",
                "router",
                "--port",
                str(self.port),
                "--model",
                model,
                "--served-model-name",
                "tiny",
                *flags,
            ],
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        try:
            wait_ready(self.url, self.proc, 60)
        except RuntimeError:
            self.stop()
            raise

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)


def connector(kind: str, role: str, url: str) -> str:
    if kind == "kv":
        return json.dumps(
            {
                "kv_connector": "RedisConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"url": url},
            }
        )
    return json.dumps(
        {
            "ec_connector": "RedisECConnector",
            "ec_role": role,
            "ec_connector_extra_config": {"url": url},
        }
    )


KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


def role_pod(model: str, role: str, url: str, images: bool = False) -> ServerProcess:
    """An engine pod of ``role`` sharing one redis-server (and hash seed) with its pool."""
    flags = ["--role", role, "--hash-seed", "s"]
    if role in KV_ROLE:
        flags += ["--kv-transfer-config", connector("kv", KV_ROLE[role], url)]
    if images:
        ec_role = "ec_producer" if role == "encoder" else "ec_consumer"
        flags += ["--ec-transfer-config", connector("ec", ec_role, url)]
    return ServerProcess(model, *flags, api_key=None)


def endpoint(srv: ServerProcess) -> str:
    return f"{srv.url},events=none,replay=none"


@pytest.fixture
def pd_pool(models, redis_url):
    model = str(models.get("llama"))
    pods, router = [], None
    try:
        for role in ("prefill", "decode"):
            pods.append(role_pod(model, role, redis_url))
        router = RouterProcess(
            model,
            "--strategy",
            "prefix+load",
            "--prefill-endpoint",
            endpoint(pods[0]),
            "--decode-endpoint",
            endpoint(pods[1]),
        )
        yield router, pods
    finally:
        if router is not None:
            router.stop()
        for srv in pods:
            srv.stop()


def test_pd_router_answers_like_one_pod_and_streams_from_the_decode_pod(pd_pool, models):
    from epdserve.engine import LLM, SamplingParams

    router, (prefill, decode) = pd_pool
    prompt = "def fibonacci(n):\n    " * 6
    out = httpx.post(
        router.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0},
    ).json()
    llm = LLM(model=str(models.get("llama")), max_model_len=512)
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
    assert out["choices"][0]["text"] == want
    assert decode.metric("vllm:external_prefix_cache_hits_total") >= 16
    assert prefill.metric("vllm:generation_tokens_total") == 1  # prefill only made one token
    with httpx.stream(
        "POST",
        router.url + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 10,
            "temperature": 0,
            "stream": True,
        },
    ) as resp:
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in resp.iter_lines()
            if line.startswith("data: {")
        )
    assert text == want


def test_pd_router_falls_back_to_the_decode_pod_when_prefill_is_down(pd_pool):
    router, (prefill, decode) = pd_pool
    prefill.stop()
    resp = httpx.post(
        router.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "x = 1\n" * 10, "max_tokens": 4, "temperature": 0},
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow  # ~28 s: CI runs it after make test
def test_epd_router_sends_images_to_the_encoder_first(models, redis_url):
    model = str(models.get("gemma3"))
    pods, router = [], None
    try:
        for role in ("encoder", "prefill", "decode"):
            pods.append(role_pod(model, role, redis_url, images=True))
        router = RouterProcess(
            model,
            "--encoder-endpoint",
            endpoint(pods[0]),
            "--prefill-endpoint",
            endpoint(pods[1]),
            "--decode-endpoint",
            endpoint(pods[2]),
        )
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (80, 50), (200, 10, 30)).save(buf, format="PNG")
        image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        body = {
            "model": "tiny",
            "max_tokens": 6,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image}},
                        {"type": "text", "text": "what is it? " * 4},
                    ],
                }
            ],
        }
        sent = [p.metric("epdserve:core_input_bytes_total") for p in pods]
        first = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60).json()
        again = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert (
            first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
        )
        assert pods[0].metric("epdserve:encoder_runs_total") == 1  # the repeat hit the store
        assert pods[1].metric("epdserve:encoder_runs_total") == 0
        assert pods[2].metric("epdserve:encoder_runs_total") == 0
        assert 'reason="encoder_affinity"' in router.metrics()
        # the encoder's processed prompt went on: no pixels reached the other pods' cores
        grew = [
            p.metric("epdserve:core_input_bytes_total") - s for p, s in zip(pods, sent, strict=True)
        ]
        pixels = 3 * 64 * 64 * 4  # the tiny Gemma3's processed image, float32
        assert grew[0] > pixels and grew[1] < pixels / 4 and grew[2] < pixels / 4, grew
    finally:
        if router is not None:
            router.stop()
        for srv in pods:
            srv.stop()
