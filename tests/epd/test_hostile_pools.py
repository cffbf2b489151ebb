"""The hostile-input table through the router of a P/D pool and of an E/P/D pool (real
pods, a real redis-server), plus hostile images and image bombs, sent to the router and
straight to each pod of the E/P/D pool (each decodes images for itself). Every case gets
its 4xx, and ends with every pod's engine core the same process, a normal request answered
and no pod holding a request or a KV block."""

from __future__ import annotations

import pytest
from hostile_inputs import (
    IMAGE_BOMBS,
    TABLE,
    Hostile,
    assert_intact,
    check,
    colliding_request_ids,
    send,
)
from image_bombs import data_url, png_header_only, saved, small
from test_router_disagg import RouterProcess, endpoint, role_pod


def png() -> bytes:
    return small("PNG", (32, 24))


def tiff() -> bytes:
    from PIL import Image

    return saved(Image.new("RGB", (8, 8)), "TIFF")


def image_chat(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": "what is it?"})
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}


def hostile_image(name: str, *urls: str, param="messages[0].content[0]") -> Hostile:
    return Hostile(name, image_chat(*urls), path="/v1/chat/completions", param=param)


IMAGES = [
    hostile_image("broken base64", "data:image/png;base64,!!!not-base64!!!"),
    hostile_image("a data URL that is not base64", "data:image/png,rawbytes"),
    hostile_image("bytes that are not an image", data_url(b"hello, world")),
    hostile_image("a decompression bomb header", data_url(png_header_only(50_000, 50_000))),
    hostile_image("an image format not accepted", data_url(tiff(), "image/tiff")),
    hostile_image("an http URL off the allow-list", "http://169.254.169.254/latest/meta-data"),
    hostile_image("a file URL with no local media path", "file:///etc/passwd"),
    hostile_image("an unknown URL scheme", "gopher://example.com/x.png"),
    hostile_image(
        "nine images (the limit is eight)",
        *[data_url(png())] * 9,
        param="messages[0].content[8]",
    ),
]


@pytest.fixture(scope="module")
def pools(models, redis_server):
    """A P/D pool of the text model and an E/P/D pool of the image+text model."""
    if redis_server.proc is None:
        redis_server.start()
    url = redis_server.url
    text, image = str(models.get("llama")), str(models.get("gemma3"))
    pods, routers = {}, {}
    try:
        for role in ("prefill", "decode"):
            pods[f"pd-{role}"] = role_pod(text, role, url)
        for role in ("encoder", "prefill", "decode"):
            pods[f"epd-{role}"] = role_pod(image, role, url, images=True)
        routers["pd"] = RouterProcess(
            text,
            "--prefill-endpoint",
            endpoint(pods["pd-prefill"]),
            "--decode-endpoint",
            endpoint(pods["pd-decode"]),
        )
        routers["epd"] = RouterProcess(
            image,
            *("--encoder-endpoint", endpoint(pods["epd-encoder"])),
            *("--prefill-endpoint", endpoint(pods["epd-prefill"])),
            *("--decode-endpoint", endpoint(pods["epd-decode"])),
        )
        yield routers, pods
    finally:
        for process in [*routers.values(), *pods.values()]:
            process.stop()


def members(pods: dict, pool: str) -> dict:
    return {name: srv for name, srv in pods.items() if name.startswith(pool + "-")}


def normal(pool: str) -> tuple[str, dict]:
    if pool == "epd":
        return "/v1/chat/completions", image_chat(data_url(png()))
    return "/v1/completions", {"model": "tiny", "prompt": "x = 1", "max_tokens": 3}


@pytest.mark.parametrize("pool", ["pd", "epd"])
def test_every_hostile_input_through_a_disaggregated_pool_gets_a_4xx(pools, pool):
    routers, pods = pools
    pool_pods = members(pods, pool)
    cores = {name: srv.core_pid() for name, srv in pool_pods.items()}
    path, body = normal(pool)
    url = routers[pool].url
    # a P/D router sets kv_transfer_params itself, so a client's are replaced, not refused
    cases = [c for c in TABLE if "kv_transfer_params" not in (c.body or {})]
    cases += [*IMAGES, *IMAGE_BOMBS] if pool == "epd" else []
    for case in cases:
        check(send(url, case), case)
        assert_intact(case.name, pool_pods, cores, url, path, body)
    colliding_request_ids(url, path, body)
    assert_intact("colliding X-Request-Id headers", pool_pods, cores, url, path, body)


@pytest.mark.parametrize("role", ["encoder", "prefill", "decode"])
def test_each_epd_pod_refuses_every_image_bomb_from_its_header(pools, role):
    """The router sends a request's image parts to every pod of an E/P/D pool, and each
    decodes them for itself, so each must refuse a bomb before decoding it."""
    routers, pods = pools
    pool_pods = members(pods, "epd")
    cores = {name: srv.core_pid() for name, srv in pool_pods.items()}
    path, body = normal("epd")
    for case in IMAGE_BOMBS:
        check(send(pods[f"epd-{role}"].url, case), case)
    assert_intact(
        f"image bombs sent to the {role} pod", pool_pods, cores, routers["epd"].url, path, body
    )
