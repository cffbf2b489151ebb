"""Redis backend specifics: faults (down, slow, garbage), recovery, passwords, TLS URLs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import redis
import torch

from epdserve.connectors.storage import AsyncBlockStore, CircuitBreaker, KVBlockIO
from epdserve.connectors.storage.redis_store import redact_url, resolve_redis_url


def _wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _with_fake_clock(store) -> FakeClock:
    clock = FakeClock()
    store.breaker = CircuitBreaker(1.0, 8.0, clock=clock)
    return clock


def test_a_killed_server_gives_misses_and_counts_then_recovers_after_restart(
    make_store, redis_server
):
    store = make_store("redis")
    clock = _with_fake_clock(store)
    assert store.put_many([("a", b"1")]) == [True]
    redis_server.stop()
    try:
        assert store.get_many(["a", "b"]) == [None, None]
        assert store.put_many([("c", b"3")]) == [False]
        assert store.exists_many(["a"]) == [False] and store.delete_many(["a"]) == 0
        stats = store.stats.snapshot()
        assert stats["get_failures"] == 2 and stats["put_failures"] == 1
        assert stats["skipped"] >= 1  # calls after the first fault did not touch the network
        clock.now += 100
        assert store.get_many(["a"]) == [None]  # a probe after the backoff: still down
    finally:
        redis_server.start()
    assert store.get_many(["a"]) == [None]  # still inside the (doubled) backoff window
    clock.now += 100
    assert store.get_many(["a"]) == [None]  # back, but restarted empty: a plain miss
    assert store.put_many([("a", b"1")]) == [True] and store.get_many(["a"]) == [b"1"]
    assert store.stats.reconnects == 1


def test_a_server_killed_under_load_never_raises_and_saves_resume_after_restart(
    make_store, redis_server, meta, make_cache
):
    store = make_store("redis", backoff_initial_s=0.02, backoff_max_s=0.1)
    io, cache = KVBlockIO(store, "pool", meta), make_cache()
    worker = AsyncBlockStore(store)
    results, stop = [], threading.Event()

    def loop():
        while not stop.is_set():
            results.append(io.save(cache, [1, 2, 3], [b"\x01", b"\x02", b"\x03"]))
            results.append(io.load(cache, [4, 5, 6], [b"\x01", b"\x02", b"\x03"]))

    running = worker.submit(loop)
    try:
        _wait_until(lambda: len(results) >= 10 or running.done())
        redis_server.stop()
        try:
            failures = store.stats.put_failures + store.stats.get_failures
            _wait_until(lambda: store.stats.put_failures + store.stats.get_failures > failures)
        finally:
            redis_server.start()
        _wait_until(lambda: store.stats.reconnects > 0 or running.done())
    finally:
        stop.set()
        worker.close(close_store=False)
    running.result(0)  # the loop never raised
    assert store.stats.reconnects >= 1 and io.stats.save_failures > 0
    assert io.save(cache, [1], [b"\x01"]) == [True]


def test_the_breaker_backs_off_exponentially_up_to_its_cap():
    clock = FakeClock()
    breaker = CircuitBreaker(1.0, 4.0, clock=clock)
    delays = []
    for _ in range(4):
        breaker.record_failure()
        start = clock.now
        while not breaker.allow():
            clock.now += 0.5
        delays.append(clock.now - start)
    assert delays == [1.0, 2.0, 4.0, 4.0]
    assert breaker.record_success() is True and breaker.allow() and not breaker.is_down


def test_a_stalled_server_times_out_into_misses_and_recovers(make_store, redis_server):
    store = make_store("redis", socket_timeout_s=0.3)
    clock = _with_fake_clock(store)
    store.put_many([("a", b"1")])
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        assert store.get_many(["a"]) == [None]
        assert store.put_many([("b", b"2")]) == [False]  # skipped: breaker is open
        assert store.stats.get_failures == 1 and store.stats.skipped == 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    clock.now += 100
    assert store.get_many(["a"]) == [b"1"] and store.stats.reconnects == 1


def test_a_value_of_the_wrong_type_or_corrupt_bytes_is_a_miss(make_store, meta, make_cache):
    store = make_store("redis")
    io = KVBlockIO(store, "pool", meta)
    client = redis.Redis.from_url(store.config.url)
    try:
        client.rpush(io.key(b"\x01"), b"not", b"a", b"string")
        client.set(io.key(b"\x02"), os.urandom(5000))
        assert io.load(torch.zeros(make_cache().shape), [1, 2], [b"\x01", b"\x02"]) == [False] * 2
        assert store.stats.rejected == 1 and io.stats.rejected == 1
        assert store.stats.get_failures == 0 and not store.breaker.is_down
        assert client.exists(io.key(b"\x01"), io.key(b"\x02")) == 0  # both deleted
    finally:
        client.close()


def test_values_over_the_size_limit_are_rejected_on_read(make_store):
    store = make_store("redis", max_value_bytes=1000)
    store.put_many([("big", b"x" * 2000), ("small", b"y")])
    assert store.get_many(["big", "small"]) == [None, b"y"]
    assert store.stats.rejected == 1
    assert store.exists_many(["big", "small"]) == [False, True]  # deleted: never read again


def test_values_expire_after_the_ttl(make_store):
    store = make_store("redis", ttl_s=0.05)
    store.put_many([("a", b"1")])
    time.sleep(0.2)
    assert store.get_many(["a"]) == [None]


def test_batches_larger_than_a_chunk_are_split_and_keep_their_order(make_store):
    store = make_store("redis", chunk_keys=3, chunk_bytes=10)
    items = [(f"k{i}", bytes([i]) * (i + 1)) for i in range(10)]
    assert store.put_many(items) == [True] * 10
    assert store.get_many([k for k, _ in items] + ["none"]) == [v for _, v in items] + [None]
    assert store.delete_many([k for k, _ in items]) == 10


def test_an_unreachable_url_at_startup_is_soft(make_store):
    store = make_store("redis", url="redis://127.0.0.1:1/0", connect_timeout_s=0.2)
    assert store.put_many([("a", b"1")]) == [False] and store.get_many(["a"]) == [None]


def test_password_comes_from_the_url_config_or_environment(monkeypatch):
    monkeypatch.setenv("EPDSERVE_REDIS_PASSWORD", "env p@ss")
    assert resolve_redis_url("redis://h:6379/0") == "redis://:env%20p%40ss@h:6379/0"
    assert resolve_redis_url("redis://u@h/0", "cfg") == "redis://u:cfg@h/0"
    assert resolve_redis_url("rediss://:url@h/0", "cfg") == "rediss://:url@h/0"
    assert redact_url("rediss://u:secret@h:1/0") == "rediss://u:***@h:1/0"
    with pytest.raises(ValueError, match="url"):
        resolve_redis_url("http://h/0")


def test_a_rediss_url_uses_tls(make_store):
    store = make_store("redis", url="rediss://127.0.0.1:1/0")
    assert store.pool.connection_class is redis.SSLConnection


@pytest.fixture
def password_server(tmp_path):
    """A second redis-server that requires a password."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    binary = shutil.which("redis-server") or pytest.skip("no redis-server on PATH")
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen([*argv, "--requirepass", "s3cret", "--dir", str(tmp_path)])
    try:
        client = redis.Redis(port=port, password="s3cret")
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(5)


def test_a_password_from_the_environment_authenticates(
    make_store, password_server, monkeypatch, caplog
):
    monkeypatch.delenv("EPDSERVE_REDIS_PASSWORD", raising=False)
    wrong = make_store("redis", url=password_server)
    assert wrong.put_many([("a", b"1")]) == [False] and wrong.stats.put_failures == 1
    assert wrong.breaker.is_down and "AuthenticationError" in caplog.text  # logged, backs off
    monkeypatch.setenv("EPDSERVE_REDIS_PASSWORD", "s3cret")
    store = make_store("redis", url=password_server)
    assert store.put_many([("a", b"1")]) == [True] and store.get_many(["a"]) == [b"1"]


def test_a_flushed_server_gives_plain_misses(make_store, meta, make_cache):
    store = make_store("redis")
    io = KVBlockIO(store, "pool", meta)
    io.save(make_cache(), [1], [b"\x01"])
    client = redis.Redis.from_url(store.config.url)
    client.flushall()
    client.close()
    assert io.load(torch.zeros(make_cache().shape), [1], [b"\x01"]) == [False]
    assert store.stats.get_failures == 0 and io.stats.rejected == 0


@pytest.fixture
def garbage_server():
    """A TCP server on a free port that answers anything with an HTTP error page."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.05)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n<html>no</html>\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    stop.set()
    thread.join(5)
    server.close()


def test_a_server_answering_garbage_gives_misses_and_counts(make_store, garbage_server):
    store = make_store("redis", url=garbage_server, socket_timeout_s=0.5, backoff_initial_s=0)
    assert store.get_many(["a", "b"]) == [None, None]
    assert store.put_many([("a", b"x")]) == [False]
    assert store.exists_many(["a"]) == [False] and store.delete_many(["a"]) == 0
    assert store.stats.get_failures == 2 and store.stats.put_failures == 1
    assert store.breaker.is_down
