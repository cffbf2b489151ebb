"""A pool's KV events travel over CurveZMQ by default: the operator's key Secret reaches the
engine and router pods, the router indexes the engines' events, and a subscriber without the
pool's client key is refused at the handshake."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import zmq
from cluster import wait_for
from pools_e2e import MODEL_PATH, NS, example, for_this_machine, write
from zmq.utils.monitor import recv_monitor_message

from epdserve.common import metrics_text

pytestmark = pytest.mark.e2e
NAME = "curved"
OUTCOMES = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "accepted",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused",
}


@pytest.fixture(scope="module")
def pool(cluster, tmp_path_factory):
    body = for_this_machine(example("colocated-text"), MODEL_PATH, replicas={"colocated": 1})
    body["metadata"]["name"] = NAME
    cluster.kubectl("apply", "-f", write(tmp_path_factory.mktemp("c"), body))
    try:
        cluster.kubectl(
            "wait", f"inferencepool/{NAME}", "--for=condition=Ready", "--timeout=240s", timeout=260
        )
        yield body
    finally:
        cluster.kubectl("delete", "inferencepool", NAME, "--wait=false", check=False)
        wait_for(lambda: not cluster.pods(NS, f"app.kubernetes.io/instance={NAME}"), 60, "gone")


def curve_keys(cluster) -> dict[str, bytes]:
    out = cluster.kubectl("get", "secret", f"{NAME}-kv-events-curve", "-o", "json")
    return {k: base64.b64decode(v) for k, v in json.loads(out)["data"].items()}


def pod_ip(cluster, selector: str) -> str:
    return cluster.pods(NS, selector)[0]["status"]["podIP"]


def test_the_router_indexes_the_engines_events_over_curve(cluster, pool):
    router = pod_ip(cluster, f"epdserve.io/router={NAME}")
    served = pool["spec"]["model"]["name"]
    # longer than one 128-token block (the cpu default): only full blocks make events
    chat = {"model": served, "messages": [{"role": "user", "content": "def fib(n):" * 40}]}
    response = httpx.post(
        f"http://{router}:8000/v1/chat/completions", json={**chat, "max_tokens": 4}, timeout=60
    )
    assert response.status_code == 200, response.text

    def received() -> float:
        text = httpx.get(f"http://{router}:8000/metrics", timeout=10).text
        return metrics_text.total(text, "epdserve_router:kv_events_received_total")

    assert wait_for(received, 60, "events indexed by the router") > 0


def handshake(address: str, keys: dict[str, bytes] | None) -> str:
    """Connect a SUB socket (a Curve client when `keys` are given) and report whether the
    engine's publisher accepted or refused the handshake."""
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    if keys is not None:
        sub.curve_serverkey = keys["server.public"]
        sub.curve_publickey, sub.curve_secretkey = keys["client.public"], keys["client.secret"]
    monitor = sub.get_monitor_socket()
    try:
        sub.connect(address)
        while monitor.poll(30_000):
            event = recv_monitor_message(monitor)["event"]
            if event in OUTCOMES:
                return OUTCOMES[event]
        return "no answer"
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)


def test_only_the_pools_client_key_completes_the_handshake(cluster, pool):
    keys = curve_keys(cluster)
    assert sorted(keys) == ["client.public", "client.secret", "server.public", "server.secret"]
    address = f"tcp://{pod_ip(cluster, f'epdserve.io/pool={NAME}')}:5557"
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger = {**keys, "client.public": stranger_public, "client.secret": stranger_secret}
    assert handshake(address, keys) == "accepted"
    assert handshake(address, stranger) == "refused"
    assert handshake(address, None) == "refused"  # plain ZMQ, as a vLLM-style subscriber
