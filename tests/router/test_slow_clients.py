"""Header and body read deadlines (``connectors/slow_clients.py``): on uvicorn's httptools
and h11 protocols alike, in-process, and on the real router; the router's concurrency limit."""

from __future__ import annotations

import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from epdserve.connectors.slow_clients import BodyReadTimeout, guarded_protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def echo_body(scope, receive, send) -> None:
    """Reads the whole body, answers its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def server(request):
    port = free_port()
    config = uvicorn.Config(
        BodyReadTimeout(echo_body, timeout=1.0),
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(header_timeout=1.0, max_header_bytes=4096, base=request.param),
        timeout_keep_alive=1,
        log_level="warning",
        lifespan="off",
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    srv.should_exit = True
    thread.join(10)


def exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def test_unfinished_headers_get_408(server):
    assert exchange(server, b"POST / HTTP/1.1\r\nHost: x\r\n").startswith(b"HTTP/1.1 408")


def test_an_idle_connection_is_closed_without_an_answer(server):
    assert exchange(server, b"") == b""


def test_oversized_headers_get_431(server):
    answer = exchange(server, b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 6000)
    assert answer.startswith(b"HTTP/1.1 431")


def test_an_unfinished_body_gets_408(server):
    answer = exchange(server, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    assert answer.startswith(b"HTTP/1.1 408") and b'"param": "body"' in answer


def test_a_request_and_a_second_on_the_same_connection_are_served(server):
    with socket.create_connection(("127.0.0.1", server), timeout=30) as s:
        for _ in range(2):
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            answer = b""
            while not answer.endswith(b"\r\n\r\n3"):
                assert select.select([s], [], [], 30)[0], answer
                chunk = s.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(0.5)  # idle, within keep-alive: the next headers are still awaited


def test_the_router_cuts_slow_headers_and_bodies(spawn, models):
    pod = spawn.standin(models.get("llama"))
    router = spawn.router([pod], "--header-read-timeout", "1", "--body-read-timeout", "1")
    port = int(router.url.rsplit(":", 1)[1])
    assert exchange(port, b"POST /v1/completions HTTP/1.1\r\n").startswith(b"HTTP/1.1 408")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 50\r\n\r\n{"
    assert exchange(port, head).startswith(b"HTTP/1.1 408")
    failures = spawn.metric(
        router.url, "epdserve_router:request_failures_total", {"reason": "body_timeout"}
    )
    assert failures == 1
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200


def test_past_its_concurrency_limit_the_router_answers_503_with_retry_after(spawn, models):
    """In OpenAI's error shape with Retry-After (uvicorn's own is plain text without it)."""
    pod = spawn.standin(models.get("llama"))
    router = spawn.router([pod], "--limit-concurrency", "4", "--header-read-timeout", "600")
    port = int(router.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
    try:
        r = httpx.get(router.url + "/v1/models", timeout=30)
    finally:
        for s in idle:
            s.close()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "concurrency" in error["message"]
