"""The pixel budget on every pod of an E/P/D pool: the router sends a request's image parts
to the encoder, the prefill and the decode pod, and each decodes them for itself, so each
must refuse a bomb from its header. Real pods, a real router and a real redis-server."""

from __future__ import annotations

import httpx
import pytest
from hostile_inputs import IMAGE_BOMBS, check, send
from image_bombs import data_url, small
from test_router_disagg import RouterProcess, endpoint, role_pod

ROLES = ("encoder", "prefill", "decode")


@pytest.fixture(scope="module")
def pool(models, redis_server):
    if redis_server.proc is None:
        redis_server.start()
    model = str(models.get("gemma3"))
    pods, router = {}, None
    try:
        for role in ROLES:
            pods[role] = role_pod(model, role, redis_server.url, images=True)
        flags = [f for r in ROLES for f in (f"--{r}-endpoint", endpoint(pods[r]))]
        router = RouterProcess(model, *flags)
        yield router, pods
    finally:
        for process in [router, *pods.values()]:
            if process is not None:
                process.stop()


def image_chat(url: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}


@pytest.mark.parametrize("target", ["router", *ROLES])
def test_every_pod_refuses_every_image_bomb_and_the_pool_still_serves(pool, target):
    router, pods = pool
    cores = {role: pod.core_pid() for role, pod in pods.items()}
    url = router.url if target == "router" else pods[target].url
    for case in IMAGE_BOMBS:
        check(send(url, case), case)
    assert {role: pod.core_pid() for role, pod in pods.items()} == cores
    resp = httpx.post(
        router.url + "/v1/chat/completions", json=image_chat(data_url(small())), timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
