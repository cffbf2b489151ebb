"""The engine's KV-event sockets: where they bind, and who may connect when Curve is on.

Real sockets throughout; the clients below speak DESIGN.md §3 with plain pyzmq (plus the
router's Curve client keys), not our subscriber.
"""

from __future__ import annotations

import socket

import pytest
import zmq

from epdserve.connectors.kv_events import (
    BlockRemoved,
    CurveClientKeys,
    CurveKeyError,
    CurveServerKeys,
    KVEventsConfig,
    bind_address,
    create_publisher,
)
from epdserve.connectors.kv_events.config import pod_ip_from_env

END = (-1).to_bytes(8, "big", signed=True)


def config(events: str, replay: str | None = None) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=events, replay_endpoint=replay
    )


def connect(ctx, kind, address: str, keys: CurveClientKeys | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if keys is not None:
        keys.apply(sock)
    sock.connect(address)
    return sock


def publish_until_received(publisher, sub: zmq.Socket, tries: int = 300) -> list[bytes]:
    """Publish probes until one reaches ``sub`` (slow joiner); returns that message."""
    for i in range(tries):
        publisher.publish([BlockRemoved([i], "GPU")])
        if sub.poll(30):
            return sub.recv_multipart()
    raise AssertionError("no event reached the subscriber")


def replay(dealer: zmq.Socket, start: int = 0, timeout_ms: int = 5000) -> list[int]:
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    while dealer.poll(timeout_ms):
        _, _, seq, _ = dealer.recv_multipart()
        if seq == END:
            return seqs
        seqs.append(int.from_bytes(seq, "big"))
    raise AssertionError("replay did not end")


# --- binding --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "pod_ip", "bound"),
    [
        ("tcp://*:5557", "10.1.2.3", "tcp://10.1.2.3:5557"),
        ("tcp://*:5557", "fd00::7", "tcp://[fd00::7]:5557"),
        ("tcp://*:5557", None, "tcp://*:5557"),
        ("tcp://0.0.0.0:5557", "10.1.2.3", "tcp://0.0.0.0:5557"),
        ("ipc:///tmp/ev.ipc", "10.1.2.3", "ipc:///tmp/ev.ipc"),
    ],
)
def test_only_a_wildcard_tcp_endpoint_takes_the_pod_ip(endpoint, pod_ip, bound):
    assert bind_address(endpoint, pod_ip) == bound


def test_the_pod_ip_variable_must_hold_an_ip(monkeypatch):
    monkeypatch.setenv("EPDSERVE_POD_IP", "pod-7")
    with pytest.raises(ValueError, match="EPDSERVE_POD_IP"):
        pod_ip_from_env()
    monkeypatch.setenv("EPDSERVE_POD_IP", "")
    assert pod_ip_from_env() is None


def test_with_a_pod_ip_both_sockets_listen_on_that_address_only(monkeypatch, ctx, free_port):
    monkeypatch.setenv("EPDSERVE_POD_IP", "127.0.0.2")
    events, rport = free_port(), free_port()
    publisher = create_publisher(config(f"tcp://*:{events}", f"tcp://*:{rport}"))
    try:
        assert publisher.address == f"tcp://127.0.0.2:{events}"
        assert publisher.replay_address == f"tcp://127.0.0.2:{rport}"
        for port in (events, rport):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
        sub = connect(ctx, zmq.SUB, f"tcp://127.0.0.2:{events}")
        publish_until_received(publisher, sub)
        dealer = connect(ctx, zmq.DEALER, f"tcp://127.0.0.2:{rport}")
        assert replay(dealer)  # the probes are buffered
    finally:
        publisher.close()


def test_an_explicit_endpoint_still_connects_as_configured(monkeypatch, ctx, free_port):
    monkeypatch.setenv("EPDSERVE_POD_IP", "127.0.0.2")
    port = free_port()
    sub = ctx.socket(zmq.SUB)  # the subscriber binds; vLLM's rule makes the PUB connect
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    publisher = create_publisher(config(f"tcp://127.0.0.1:{port}"))
    try:
        assert publisher.address == f"tcp://127.0.0.1:{port}"
        publish_until_received(publisher, sub)
    finally:
        publisher.close()


# --- Curve ----------------------------------------------------------------------------


@pytest.fixture
def curve_publisher(curve_dirs, free_port):
    events, rport = free_port(), free_port()
    cfg = config(f"tcp://*:{events}", f"tcp://*:{rport}")
    publisher = create_publisher(cfg, curve_dir=curve_dirs.engine)
    publisher.urls = (f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{rport}")
    yield publisher
    publisher.close()


def test_the_listed_client_receives_live_events_and_replays(curve_publisher, curve_dirs, ctx):
    keys = CurveClientKeys.load(curve_dirs.router)
    sub = connect(ctx, zmq.SUB, curve_publisher.urls[0], keys)
    topic, seq, payload = publish_until_received(curve_publisher, sub)
    assert len(seq) == 8 and payload
    dealer = connect(ctx, zmq.DEALER, curve_publisher.urls[1], keys)
    assert int.from_bytes(seq, "big") in replay(dealer)
    assert curve_publisher.stats.auth_denied == 0


def test_an_unlisted_key_gets_neither_events_nor_replays(
    curve_publisher, curve_dirs, ctx, wait_for
):
    good = connect(ctx, zmq.SUB, curve_publisher.urls[0], CurveClientKeys.load(curve_dirs.router))
    stranger = CurveClientKeys.load(curve_dirs.stranger)
    bad_sub = connect(ctx, zmq.SUB, curve_publisher.urls[0], stranger)
    wait_for(lambda: curve_publisher.stats.auth_denied >= 1, what="SUB refused")
    publish_until_received(curve_publisher, good)
    for i in range(20):  # the listed client gets all of these; the stranger none
        curve_publisher.publish([BlockRemoved([i], "GPU")])
    got = 0
    while good.poll(1000) and got < 20:
        good.recv_multipart()
        got += 1
    assert got == 20 and not bad_sub.poll(0)
    denied = curve_publisher.stats.auth_denied
    bad_dealer = connect(ctx, zmq.DEALER, curve_publisher.urls[1], stranger)
    bad_dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    wait_for(lambda: curve_publisher.stats.auth_denied > denied, what="DEALER refused")
    assert not bad_dealer.poll(300) and curve_publisher.stats.replay_requests == 0


def test_a_client_without_curve_gets_nothing(curve_publisher, curve_dirs, ctx):
    good = connect(ctx, zmq.SUB, curve_publisher.urls[0], CurveClientKeys.load(curve_dirs.router))
    plain = connect(ctx, zmq.SUB, curve_publisher.urls[0])
    publish_until_received(curve_publisher, good)
    curve_publisher.publish([BlockRemoved([1], "GPU")])
    assert good.poll(5000) and not plain.poll(300)


def test_client_public_may_list_several_keys(curve_dirs, free_port, ctx):
    second_public, second_secret = zmq.curve_keypair()
    listed = curve_dirs.engine / "client.public"
    listed.write_bytes(curve_dirs.client_public + b"\n\n" + second_public + b"\n")
    second = CurveClientKeys(second_public, second_secret, curve_dirs.server_public)
    port = free_port()
    publisher = create_publisher(config(f"tcp://*:{port}"), curve_dir=curve_dirs.engine)
    try:
        sub = connect(ctx, zmq.SUB, f"tcp://127.0.0.1:{port}", second)
        publish_until_received(publisher, sub)
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("side", "file", "content", "message"),
    [
        ("engine", "server.secret", None, "server.secret does not exist"),
        ("engine", "client.public", b"\n \n", "client.public lists no public key"),
        ("engine", "client.public", b"~" * 40, "client.public line 1: not Z85"),
        ("engine", "server.public", b"abc", "expected 40 Z85 characters"),
        ("router", "client.secret", None, "client.secret does not exist"),
        ("router", "server.public", b"\x80" * 40, "server.public cannot be read"),
    ],
)
def test_a_bad_key_file_is_an_error_naming_it(curve_dirs, side, file, content, message):
    directory = getattr(curve_dirs, side)
    path = directory / file
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content)
    load = CurveServerKeys.load if side == "engine" else CurveClientKeys.load
    with pytest.raises(CurveKeyError, match=message):
        load(directory)


def test_a_secret_that_does_not_match_its_public_key_is_refused(curve_dirs):
    _, other_secret = zmq.curve_keypair()
    (curve_dirs.engine / "server.secret").write_bytes(other_secret)
    with pytest.raises(CurveKeyError, match="not one key pair"):
        CurveServerKeys.load(curve_dirs.engine)


def test_keys_with_a_trailing_newline_load(curve_dirs):
    path = curve_dirs.router / "server.public"
    path.write_bytes(path.read_bytes() + b"\n")
    assert CurveClientKeys.load(curve_dirs.router).server_public == curve_dirs.server_public
