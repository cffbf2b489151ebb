"""Fetching image URLs for the API server: allow-listed http(s) through an async client with
size and time limits, ``file:`` URLs only below the allowed local path, never blocking the
event loop."""

from __future__ import annotations

import asyncio
import http.server
import io
import os
import threading
import time

import pytest

from epdserve.engine.inputs.images import ImageLimits, load_image_url_async

WHERE = "messages[0].content[0]"


def png_bytes(size=(40, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(1.5)
        body = png_bytes() if self.path != "/big.png" else b"\0" * (2 << 20)
        self.send_response(200 if self.path != "/missing.png" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def load(url: str, limits: ImageLimits):
    return asyncio.run(load_image_url_async(url, limits, WHERE))


ALLOWED = ImageLimits(allowed_hosts=frozenset({"127.0.0.1"}), fetch_timeout_s=1.0)


def test_an_allow_listed_host_is_fetched(image_server):
    loaded = load(image_server + "/ok.png", ALLOWED)
    assert loaded.image.size == (40, 30) and loaded.raw.startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "path, limits, message",
    [
        ("/ok.png", ImageLimits(), "not allowed"),
        ("/missing.png", ALLOWED, "could not fetch"),
        (
            "/big.png",
            ImageLimits(allowed_hosts=frozenset({"127.0.0.1"}), max_bytes=1 << 20),
            "larger",
        ),
        ("/slow.png", ALLOWED, "longer than"),
    ],
)
def test_fetches_that_break_a_limit_name_the_part(image_server, path, limits, message):
    with pytest.raises(ValueError, match=rf"^messages\[0\]\.content\[0\]: .*{message}"):
        load(image_server + path, limits)


def test_a_slow_fetch_leaves_the_event_loop_free(image_server):
    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        limits = ImageLimits(allowed_hosts=frozenset({"127.0.0.1"}), fetch_timeout_s=5.0)
        await load_image_url_async(image_server + "/slow.png", limits, WHERE)
        task.cancel()
        return ticks

    assert asyncio.run(scenario()) > 20  # the loop ran other work during the 1.5 s fetch


def test_file_urls_only_below_the_allowed_path(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    os.symlink(tmp_path / "secret.png", media / "link.png")
    limits = ImageLimits(local_media_path=str(media))
    assert load(f"file://{media}/a.png", limits).image.size == (40, 30)
    for url in (f"file://{media}/../secret.png", f"file://{media}/link.png"):
        with pytest.raises(ValueError, match="outside the allowed local media path"):
            load(url, limits)
    with pytest.raises(ValueError, match="file URLs are not allowed"):
        load(f"file://{media}/a.png", ImageLimits())
