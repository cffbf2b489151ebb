"""Slow clients lose their connection, not the pod: headers must arrive within
--header-read-timeout and bodies within --body-read-timeout (408 and close), headers are
bounded in size (431), and a normal client is served meanwhile."""

from __future__ import annotations

import select
import socket
import time

import httpx
import pytest
from serving_support import API_KEY, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: pod\r\n"


@pytest.fixture(scope="module")
def pod(models):
    flags = ("--header-read-timeout", "1", "--body-read-timeout", "1")
    srv = ServerProcess(str(models.get("llama")), *flags)
    yield srv
    srv.stop()


def connect(pod) -> socket.socket:
    return socket.create_connection(("127.0.0.1", pod.port), timeout=30)


def read_to_close(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_headers_that_do_not_finish_get_408_and_the_connection_closes(pod):
    with connect(pod) as s:
        s.sendall(HEAD + b"Authorization: Bearer " + API_KEY.encode())
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code": 408' in answer


def test_headers_sent_a_byte_at_a_time_are_cut_off(pod):
    request = (
        HEAD + b"Authorization: Bearer " + API_KEY.encode() + b"\r\n" + b"X-Pad: " + b"a" * 100
    )
    with connect(pod) as s:
        for byte in request:  # about 3 s in all, past the 1 s deadline
            if select.select([s], [], [], 0)[0]:
                break  # the pod answered: stop writing to a closed connection
            s.sendall(bytes([byte]))
            time.sleep(0.02)
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_a_connection_that_sends_nothing_is_closed(pod):
    with connect(pod) as s:
        assert read_to_close(s) == b""


def test_a_body_that_does_not_arrive_gets_408_in_openais_shape(pod):
    head = HEAD + b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
    head += b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    with connect(pod) as s:
        s.sendall(head + b'{"model": ')
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"param":"body"' in answer.replace(b" ", b"")


def test_headers_past_the_size_bound_get_431(pod):
    with connect(pod) as s:
        s.sendall(HEAD + b"X-Big: " + b"a" * (66 << 10))  # read whole: no reset on close
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_a_normal_client_is_served_while_slow_ones_hang(pod):
    slow = [connect(pod) for _ in range(20)]
    try:
        for s in slow:
            s.sendall(HEAD)
        r = httpx.post(pod.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for s in slow:
            s.close()


def test_a_keep_alive_connection_serves_a_second_request(pod):
    with httpx.Client(headers=AUTH, timeout=30) as client:
        for _ in range(2):
            assert client.post(pod.url + "/v1/completions", json=BODY).status_code == 200
