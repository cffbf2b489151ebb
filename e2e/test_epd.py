"""Scenario 3: the E/P/D multimodal example (tiny Gemma3) answers an image chat request, and
a repeated image is served from the encoder cache."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from capabilities import encoder_role_gap
from cluster import wait_for
from pools_e2e import NS, example, for_this_machine, readable_copy, ready_pod_ips, write

from epdserve.common import metrics_text

pytestmark = pytest.mark.e2e


def image_url(seed: int) -> str:
    from PIL import Image

    img = Image.new("RGB", (64, 64), (seed * 40 % 256, 90, 200))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(url: str, body: dict) -> dict:
    answer = httpx.post(url, json=body, timeout=180)
    assert answer.status_code == 200, answer.text
    return answer.json()


def encoder_cache_hits(text: str) -> float:
    """Sum of every sample whose metric name mentions encoder cache hits."""
    samples = metrics_text.parse(text)
    return sum(s.value for s in samples if "encoder_cache" in s.name and "hit" in s.name)


def pool_hits(ips: list[str]) -> float:
    """Encoder-cache hits over the pool's engine pods (encoder, prefill and decode)."""
    return sum(
        encoder_cache_hits(httpx.get(f"http://{ip}:8000/metrics", timeout=10).text) for ip in ips
    )


@pytest.mark.slow  # ~27 s: CI runs it after make test
def test_epd_pool_answers_an_image_chat_and_reuses_encoder_outputs(cluster, e2e_workdir, tmp_path):
    gap = encoder_role_gap()
    if gap:
        pytest.skip(gap)
    from epdserve.engine.make_model import make_model

    weights = cluster.claims["model-weights"] / "gemma-3-4b-it"
    if not weights.exists():
        built = make_model("gemma3", e2e_workdir / "build" / "tiny-gemma3", seed=0)
        readable_copy(built, weights)
    if "epd-cache" not in cluster.claims:
        shared = e2e_workdir / "pv" / "epd-cache"
        shared.mkdir(parents=True, exist_ok=True)
        shared.chmod(0o777)
        cluster.claim("epd-cache", shared)
    pool = for_this_machine(
        example("epd-multimodal"), replicas={"encoder": 1, "prefill": 1, "decode": 1}
    )
    name, served = pool["metadata"]["name"], pool["spec"]["model"]["name"]
    cluster.kubectl("apply", "-f", write(tmp_path, pool))
    try:
        cluster.kubectl(
            "wait", f"ipool/{name}", "--for=condition=Ready", "--timeout=300s", timeout=320
        )
        router = f"http://{cluster.service_ip(NS, name)}/v1/chat/completions"
        content = [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": image_url(1)}},
        ]
        body = {"model": served, "messages": [{"role": "user", "content": content}]}
        body.update(max_tokens=8, temperature=0)
        answer = httpx.post(router, json=body, timeout=180)
        assert answer.status_code == 200, answer.text
        first = answer.json()
        assert first["choices"][0]["message"]["content"]
        engines = ready_pod_ips(cluster, f"epdserve.io/pool={name}")
        before = pool_hits(engines)
        again = chat(router, body)
        assert (
            again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        )
        after = pool_hits(engines)
        assert after > before, "the repeated image was encoded again"
    finally:
        cluster.kubectl("delete", "ipool", name, "--ignore-not-found", check=False)
        wait_for(lambda: not cluster.api.list("Pod", NS), 90, "the pool's pods to go")
