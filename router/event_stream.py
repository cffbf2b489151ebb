"""What a pod subscriber's sockets and ingest need: socket options and ingest metrics."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from epdserve.connectors.kv_events import (
    BlockRemoved,
    BlockStored,
    CurveClientKeys,
)
from epdserve.connectors.kv_events.sockets import DEFAULT_MAX_EVENT_BYTES
from epdserve.router.index import IngestResult
from epdserve.router.metrics import RouterMetrics
from epdserve.router.reconcile import log_resync
from epdserve.router.seedcheck import RootHashCheck

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
EVENT_TYPES = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved"}


@dataclass(frozen=True)
class EventSocketOptions:
    """How the router's SUB and replay DEALER sockets talk to the pods."""

    curve: CurveClientKeys | None = None  # Curve client keys (the pods are Curve servers)
    max_message_bytes: int = DEFAULT_MAX_EVENT_BYTES  # larger frames: the pod is dropped

    def apply(self, socket: zmq.Socket) -> None:
        """Set on ``socket`` before it connects."""
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if self.curve is not None:
            self.curve.apply(socket)


def record_ingest(
    m: RouterMetrics,
    pod: str,
    result: IngestResult,
    events: list,
    root_check: RootHashCheck | None,
) -> None:
    """Metrics (and the seed check) for one applied batch of ``pod``'s events."""
    counts = dict.fromkeys(("BlockStored", "BlockRemoved", "AllBlocksCleared"), 0)
    for event in events:
        counts[EVENT_TYPES.get(type(event), "AllBlocksCleared")] += 1
    for kind, n in counts.items():
        if n:
            m.events_received.labels(pod, kind).inc(n)
    if result.orphaned:
        m.blocks_unindexed.labels(pod, "unknown_parent").inc(result.orphaned)
    if result.skipped:
        m.blocks_unindexed.labels(pod, "extra_keys_or_invalid").inc(result.skipped)
    if result.roots and root_check is not None:
        root_check.observe(pod, result.roots)
    if result.cleared:
        log_resync(m, pod, "cleared", "AllBlocksCleared: its local tier dropped")
