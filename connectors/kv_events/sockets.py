"""Opening the KV-event sockets: bind or connect (vLLM's rule), the pod IP for wildcards,
and bounds on what a socket accepts from its peers."""

from __future__ import annotations

import logging

import zmq

from epdserve.connectors.kv_events.config import bind_address, binds

log = logging.getLogger(__name__)

# what an engine's sockets accept: subscriptions (PUB) and replay requests (ROUTER) are a
# few bytes; a peer that sends more is disconnected by libzmq before we see a byte of it
MAX_REQUEST_BYTES = 64 * 1024
# what a router's SUB/DEALER accept per frame by default: one engine step's event batch
DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024


def attach(socket: zmq.Socket, endpoint: str, pod_ip: str | None, what: str) -> str:
    """Bind or connect ``socket`` as ``endpoint`` says; returns (and logs) the address."""
    if not binds(endpoint):
        socket.connect(endpoint)
        log.info("KV events: %s connected to %s", what, endpoint)
        return endpoint
    address = bind_address(endpoint, pod_ip)
    if address.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    socket.bind(address)
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    log.info("KV events: %s bound to %s", what, bound)
    return bound


def pin_io_thread(socket: zmq.Socket, context: zmq.Context, thread: int) -> None:
    """Serve ``socket`` on I/O thread ``thread`` when the context has it, so a replay flood
    (and its encryption, with Curve) never queues ahead of live events in one I/O thread."""
    if context.get(zmq.IO_THREADS) > thread:
        socket.setsockopt(zmq.AFFINITY, 1 << thread)
