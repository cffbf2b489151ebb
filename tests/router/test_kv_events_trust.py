"""Two real ``epdserve serve`` pods as the operator runs them: events bound to the pod IP
(``EPDSERVE_POD_IP``, here 127.0.0.2), Curve keys mounted as files. The router follows
them with the pool's client key and still sends a salted prefix to the pod holding it,
while the events on the wire carry neither the salt nor the prompt's token ids."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq

from epdserve.connectors.kv_events import CurveClientKeys
from epdserve.router.pods import PodEndpoint
from epdserve.router.service import Router
from epdserve.router.strategy import make_strategy
from epdserve.router.subscriber import EventSocketOptions

POD_IP = "127.0.0.2"
BS = 16
SALT = "tenant-7-secret-salt"
PROMPT = [(17 * i) % 3000 + 10 for i in range(70)]  # 4 full blocks


def write_keys(directory, **keys: bytes):
    directory.mkdir()
    for name, value in keys.items():
        (directory / name.replace("_", ".")).write_bytes(value)  # a Secret's items, as mounted
    return directory


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    server, client = zmq.curve_keypair(), zmq.curve_keypair()
    engine = write_keys(
        root / "engine", server_public=server[0], server_secret=server[1], client_public=client[0]
    )
    router = write_keys(
        root / "router", client_public=client[0], client_secret=client[1], server_public=server[0]
    )
    return engine, router


@pytest.fixture(scope="module")
def pods(module_spawn, models, keys):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EPDSERVE_POD_IP", POD_IP)  # inherited by the pods' processes
        started = [
            module_spawn.serve(models.get("llama"), "--kv-events-curve-dir", str(keys[0]))
            for _ in range(2)
        ]
    for pod in started:
        module_spawn.wait_ready(pod)
        for kind in ("events", "replay"):  # what the router connects to: the pod IP
            pod.extra[kind] = f"tcp://{POD_IP}:{pod.extra[kind]}"
    return started


def endpoint(pod) -> PodEndpoint:
    return PodEndpoint(pod.url, pod.url, pod.extra["events"], pod.extra["replay"])


def complete(pod, prompt: list[int], salt: str | None) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(pod.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def wait_for(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.05)


def warm_up(pod, indexed, seed: int) -> None:
    """Unsalted requests (new prompts) until the router indexes the pod's events: its SUB
    is connected from then on."""
    for n in range(100):
        complete(pod, [(seed * 1000 + n * 37 + t) % 3000 + 10 for t in range(20)], None)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if indexed():
                return
            time.sleep(0.02)
    raise AssertionError("the router never indexed the pod's events")


def test_event_ports_listen_on_the_pod_ip_only(pods):
    port = int(pods[0].extra["events"].rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    socket.create_connection((POD_IP, port), timeout=5).close()


def test_a_salted_prefix_is_routed_to_the_pod_that_holds_it(pods, keys, models):
    from epdserve.router.tokenize import PromptTokenizer

    options = EventSocketOptions(CurveClientKeys.load(keys[1]))
    router = Router(
        make_strategy("prefix"),
        PromptTokenizer(models.get("llama")),
        default_block_size=BS,
        event_options=options,
    )
    try:
        for i, pod in enumerate(pods):
            router.add_pod(endpoint(pod))
            warm_up(pod, lambda p=pod: router.index.pod_block_count(p.url) > 0, seed=i)
        holder = pods[1]
        complete(holder, PROMPT, SALT)
        wait_for(lambda: router.index.pod_block_count(holder.url) >= 4, what="salted blocks")
        body = {"model": "tiny", "prompt": PROMPT, "cache_salt": SALT}
        routing = router.route("/v1/completions", body)
        assert routing.order[0].pod == holder.url
        assert routing.matched == {pods[0].url: 0, holder.url: 4}
        for other in (
            {**body, "cache_salt": "another-tenant"},
            {"model": "tiny", "prompt": PROMPT},
        ):
            assert set(router.route("/v1/completions", other).matched.values()) == {0}
    finally:
        router.close()


def test_salted_events_on_the_wire_hold_no_tokens_and_no_salt(pods, keys):
    ctx = zmq.Context()
    pod = pods[0]
    listener = ctx.socket(zmq.SUB)
    CurveClientKeys.load(keys[1]).apply(listener)
    plain = ctx.socket(zmq.SUB)
    for sock in (listener, plain):
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(pod.extra["events"])
    try:
        warm_up(pod, lambda: listener.poll(0), seed=5)  # the listener's handshake is done
        while listener.poll(500):
            listener.recv_multipart()
        salted_prompt, plain_prompt = [t + 1 for t in PROMPT], [t + 2 for t in PROMPT]
        complete(pod, salted_prompt, SALT)
        complete(pod, plain_prompt, None)
        payloads, stored = [], []
        while len(stored) < 2 and listener.poll(10_000):
            payload = listener.recv_multipart()[2]
            payloads.append(payload)
            events = msgspec.msgpack.decode(payload)[1]
            stored += [e for e in events if e["type"] == "BlockStored"]
        salted, unsalted = stored[:2]
        assert salted["token_ids"] == [] and len(salted["router_keys"]) == 4
        assert "extra_keys" not in salted
        assert unsalted["token_ids"] == plain_prompt[:64] and "router_keys" not in unsalted
        assert not any(SALT.encode() in p for p in payloads)
        assert not plain.poll(0)  # a client without the pool's key heard nothing
    finally:
        listener.close(0)
        plain.close(0)
        ctx.term()


def test_the_router_cli_follows_curve_pods(module_spawn, pods, keys, models):
    router = module_spawn.router(
        pods, "--model", str(models.get("llama")), "--kv-events-curve-dir", str(keys[1])
    )
    try:
        before = module_spawn.metric(router.url, "epdserve_router:kv_events_received_total")
        complete(pods[0], [t + 3 for t in PROMPT], SALT)
        wait_for(
            lambda: (
                module_spawn.metric(router.url, "epdserve_router:kv_events_received_total") > before
            ),
            what="router received events",
        )
    finally:
        router.stop()


@pytest.mark.parametrize("command", ["serve", "router"])
def test_a_missing_key_file_stops_the_start_naming_it(command, models, tmp_path):
    args = [sys.executable, "-m", "epdserve.engine.cli", command]
    if command == "serve":
        args += [str(models.get("llama")), "--port", "1"]
    else:
        args += ["--endpoint", "http://127.0.0.1:1"]
    proc = subprocess.run(
        [*args, "--kv-events-curve-dir", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    missing = "server.public" if command == "serve" else "client.public"
    assert proc.returncode != 0
    assert f"Curve key file {tmp_path / missing} does not exist" in proc.stderr
