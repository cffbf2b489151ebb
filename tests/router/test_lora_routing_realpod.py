"""The router's adapter routing against two real ``epdserve serve --enable-lora`` pods (slow:
two engine processes): a listed adapter goes to its pod, one no pod holds is loaded on the
free pod once, and every answer equals the serving pod's own."""

from __future__ import annotations

import time

import openai
import pytest

pytestmark = pytest.mark.slow
# the pods' LoRA side (issue #29's engine part)
write_random_adapters = pytest.importorskip(
    "epdserve.engine.lora.random_adapters"
).write_random_adapters
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def tokens(url: str, model: str) -> tuple[str, list[str]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=0
    )
    return out.model, out.choices[0].logprobs.tokens


def test_adapters_route_to_their_pods_and_answer_as_those_pods(spawn, models, tmp_path):
    model = models.get("llama")
    loras = write_random_adapters(model, 2, out=tmp_path / "loras")
    flags = ("--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating")
    a = spawn.serve(model, *flags, "--lora-modules", f"lora0={loras[0]}")
    b = spawn.serve(model, *flags)
    for pod in (a, b):
        spawn.wait_ready(pod)
    router = spawn.router(
        [a, b],
        "--served-model-name",
        "tiny",
        "--lora-modules",
        f"lora1={loras[1]}",
        "--dynamic-lora",
        "--lora-models-interval",
        "0.2",
    )
    listing = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 30  # until the router has read a's list (lora0 in it)
    while "lora0" not in {m.id for m in listing.models.list()} and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # and both pods' gauges: scrapes run every 0.2 s

    assert tokens(router.url, "lora0") == tokens(a.url, "lora0")
    routed = tokens(router.url, "lora1")  # b has a free slot and no adapter: loaded there
    assert routed == tokens(b.url, "lora1") and routed[0] == "lora1"
    with pytest.raises(openai.NotFoundError):
        tokens(a.url, "lora1")  # a never got it
    loads = "epdserve_router:lora_loads_total"
    assert spawn.metric(router.url, loads, {"lora_name": "lora1", "outcome": "loaded"}) == 1
    with pytest.raises(openai.NotFoundError):
        tokens(router.url, "nope")
