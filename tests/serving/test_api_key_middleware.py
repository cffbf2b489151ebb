"""The API-key middleware answers 401 on headers alone, but first reads and drops a body
of bounded size, so the answer is not lost to a reset of the connection."""

from __future__ import annotations

import asyncio

from epdserve.engine.entrypoints.openai import middleware
from epdserve.engine.entrypoints.openai.middleware import LINGER_BYTES, APIKeyMiddleware


def call(headers: list, chunks: list[bytes], pause: float = 0.0) -> tuple[list, int]:
    """Run the middleware on one POST; the events it saw and how many chunks it read."""
    events, read = [], 0

    async def receive():
        nonlocal read
        await asyncio.sleep(pause)
        read += 1
        events.append("read")
        if read > len(chunks):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}

    async def send(message):
        events.append(message["type"])

    async def app(scope, receive, send):
        raise AssertionError("a keyless request reached the app")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(APIKeyMiddleware(app, "key")(scope, receive, send))
    return events, read


def test_a_keyless_body_is_read_to_its_end_before_the_401():
    headers = [(b"authorization", b"Bearer wrong"), (b"content-length", b"1048576")]
    events, read = call(headers, [b"a" * 65536] * 16)
    assert read == 16
    assert events[:16] == ["read"] * 16 and events[16:] == [
        "http.response.start",
        "http.response.body",
    ]


def test_a_declared_body_past_the_bound_is_not_read():
    length = str(LINGER_BYTES + 1).encode()
    events, read = call([(b"content-length", length)], [b"a"] * 3)
    assert read == 0 and events == ["http.response.start", "http.response.body"]


def test_a_slow_keyless_body_is_read_for_a_bounded_time_only(monkeypatch):
    monkeypatch.setattr(middleware, "LINGER_SECONDS", 0.2)
    events, read = call([(b"transfer-encoding", b"chunked")], [b"a"] * 100, pause=0.05)
    assert 2 <= read <= 5 and events[-2:] == ["http.response.start", "http.response.body"]


def test_an_endless_keyless_body_is_read_up_to_the_bound_only():
    chunk = b"a" * (1 << 20)
    events, read = call([(b"transfer-encoding", b"chunked")], [chunk] * 64)
    assert read == LINGER_BYTES // len(chunk) + 1
    assert events[-2:] == ["http.response.start", "http.response.body"]
