"""The hostile-input table through the router of a P/D pool and of an E/P/D pool (real
pods, a real redis-server), plus hostile images: every one a 4xx, every pod's engine
core the same process afterwards, and the pool still serving."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import pytest
from hostile_inputs import TABLE, Hostile, check, send
from test_router_disagg import RouterProcess, endpoint, role_pod


def png(width: int = 32, height: int = 24) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width x height`` pixels in a few bytes (a decompression bomb's
    header: it must be refused before anything is decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def tiff() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="TIFF")
    return buf.getvalue()


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


@pytest.mark.parametrize("pool", ["pd", "epd"])
def test_every_hostile_input_through_a_disaggregated_pool_gets_a_4xx(pools, pool):
    routers, pods = pools
    members = {name: srv for name, srv in pods.items() if name.startswith(pool + "-")}
    cores = {name: srv.core_pid() for name, srv in members.items()}
    # a P/D router sets kv_transfer_params itself, so a client's are replaced, not refused
    cases = [c for c in TABLE if "kv_transfer_params" not in (c.body or {})]
    cases += IMAGES if pool == "epd" else []
    for case in cases:
        check(send(routers[pool].url, case), case)
    assert {name: srv.core_pid() for name, srv in members.items()} == cores
    body = image_chat(data_url(png())) if pool == "epd" else None
    path = "/v1/chat/completions" if pool == "epd" else "/v1/completions"
    body = body or {"model": "tiny", "prompt": "x = 1", "max_tokens": 3}
    resp = httpx.post(routers[pool].url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
