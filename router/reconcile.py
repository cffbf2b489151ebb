"""Keeps a pod's part of the index honest: periodic checks, resyncs, and their metrics.

Every ``interval`` seconds a :class:`PodSubscriber` asks its pod, on the replay socket:
- a pod of ours answers its digest (:mod:`epdserve.connectors.kv_events.digest`): a new
  ``instance`` means the pod's publisher restarted (resync ``restart``); a digest unlike the
  one the router computed over the same batches means the index drifted (resync
  ``digest_mismatch``); an unknown router digest (after lost batches) adopts the pod's;
- a pod without a digest (vLLM, older pods answer only the end marker) gets a tail probe: a
  replay from the last applied seq must bring that batch back unchanged; an empty answer or
  another payload means a new process (resync ``restart``).
Cost per pod and check: one DEALER connect and one round trip (~40 bytes for a digest; the
batches since the last applied one for a probe), on the subscriber's own thread.

The health scrape adds one more sign for any pod whose page has it (vLLM's does):
``process_start_time_seconds`` changed between two scrapes that both succeeded means a
restart faster than the scrape interval; the pod is then resubscribed (entries dropped,
replay from seq 0).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import zmq
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from epdserve.common import metrics_text
from epdserve.connectors.kv_events.digest import (
    DIGEST_REQUEST,
    DigestAnswer,
    DigestError,
    StreamDigest,
    decode_answer,
)
from epdserve.router.index import TIERS, PrefixIndex
from epdserve.router.metrics import P, RouterMetrics

if TYPE_CHECKING:
    from epdserve.router.service import Router
    from epdserve.router.subscriber import PodSubscriber

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
RECONCILE_INTERVAL = 2.0  # s between checks of one pod
REASONS = ("restart", "cleared", "missed", "digest_mismatch")
START_METRIC = "process_start_time_seconds"
_lock = threading.Lock()


class HealingMetrics:
    """Resyncs and checks by pod, and each pod's indexed blocks (read at scrape time)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        r = metrics.registry
        self.resyncs = Counter(
            P + "index_resyncs",
            "Times a pod's index entries were dropped and rebuilt, by pod and reason "
            "(restart, cleared, missed, digest_mismatch)",
            ["pod", "reason"],
            registry=r,
        )
        self.checks = Counter(
            P + "index_checks",
            "Periodic index checks against a pod, by pod and outcome",
            ["pod", "outcome"],
            registry=r,
        )
        self._indexes: list[PrefixIndex] = []
        r.register(self)

    def watch(self, index: PrefixIndex) -> None:
        """Export ``index``'s per-pod block counts (idempotent)."""
        with _lock:
            if not any(i is index for i in self._indexes):
                self._indexes.append(index)

    def collect(self):
        family = GaugeMetricFamily(
            P + "index_pod_blocks",
            "Blocks the prefix index holds per pod and tier",
            labels=["pod", "tier"],
        )
        for index in list(self._indexes):
            for pod in index.pods():
                for tier in TIERS:
                    family.add_metric([pod, tier], index.pod_block_count(pod, tier))
        yield family


def healing_metrics(metrics: RouterMetrics) -> HealingMetrics:
    """The one :class:`HealingMetrics` of ``metrics``' registry."""
    with _lock:
        found = getattr(metrics, "_healing", None)
        if found is None:
            found = metrics._healing = HealingMetrics(metrics)
        return found


class Reconciler:
    """The periodic check of one subscriber; runs on the subscriber's thread."""

    def __init__(self, sub: PodSubscriber, interval: float = RECONCILE_INTERVAL) -> None:
        self.sub, self.interval = sub, interval
        self.instance: int | None = None  # the pod publisher's identity, once known
        self.digests = True  # until the pod answers without one
        self._mismatched = False  # the last comparison differed (a resync followed)
        self._due = 0.0  # the first check right after the initial replay

    def due(self) -> bool:
        return self.interval > 0 and time.monotonic() >= self._due

    def run(self) -> str:
        """One check; returns (and counts) its outcome."""
        self._due = time.monotonic() + self.interval
        outcome = "no_replay"
        if self.sub.replay_endpoint:
            outcome = self._check_digest() if self.digests else self._probe_tail()
        healing_metrics(self.sub.metrics).checks.labels(self.sub.pod, outcome).inc()
        return outcome

    def _check_digest(self) -> str:
        try:
            answer = self._ask_digest()
        except DigestError as exc:
            log.warning("pod %s: %s", self.sub.pod, exc)
            return "invalid"
        if isinstance(answer, str):
            return answer
        sub = self.sub
        if self.instance is not None and answer.instance != self.instance:
            sub.resync("restart", detail="its publisher's instance id changed; replaying")
            self.instance = answer.instance
            return "restart"
        self.instance = answer.instance
        if sub.next_seq < answer.next_seq:  # batches on their way: fetch exactly those
            resyncs = sub.resyncs
            sub.catch_up(sub.next_seq, stop=answer.next_seq)
            if sub.resyncs != resyncs:
                return "restart"
        if sub.next_seq < answer.next_seq:
            return "behind"
        if sub.next_seq > answer.next_seq:  # applied batches the pod never sent
            sub.resync("digest_mismatch", detail=f"applied up to {sub.next_seq - 1}, sent fewer")
            return "mismatch"
        if sub.digest is None:  # unknown since lost batches: from now on, the pod's
            sub.digest = StreamDigest(answer.tiers())
            return "adopted"
        if sub.digest.state() != answer.tiers():
            if self._mismatched:  # a resync did not help: a fault, not drift; until a
                # comparison agrees again, take the pod's digest rather than replay forever
                log.warning("pod %s: KV-event digest differs again after a resync", sub.pod)
                sub.digest = StreamDigest(answer.tiers())
                return "mismatch_again"
            self._mismatched = True
            detail = f"blocks {sub.digest.state()} here, {answer.tiers()} on the pod; replaying"
            sub.resync("digest_mismatch", detail=detail)
            return "mismatch"
        self._mismatched = False
        return "ok"

    def _ask_digest(self) -> DigestAnswer | str:
        """The pod's digest, or the outcome that stands for no answer."""
        sub = self.sub
        dealer = sub.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        sub.options.apply(dealer)
        try:
            dealer.connect(sub.replay_endpoint)
            dealer.send_multipart([b"", DIGEST_REQUEST], flags=zmq.NOBLOCK)
            if not dealer.poll(sub.replay_timeout_ms):
                return "timeout"
            frames = dealer.recv_multipart()
        except zmq.ZMQError:
            return "error"
        finally:
            dealer.close()
        if len(frames) == 4 and frames[2] == DIGEST_REQUEST:
            return decode_answer(frames[3])
        if len(frames) != 4 or frames[2] != END_SEQ:
            raise DigestError(f"not a digest answer nor an end marker ({len(frames)} frames)")
        self.digests = False  # vLLM and older pods answer with the replay end marker
        log.info("pod %s has no KV-event digest: checking it by tail probes", sub.pod)
        return "unsupported"

    def _probe_tail(self) -> str:
        sub = self.sub
        outcome = sub.poll_tail()  # with nothing applied yet: all the pod holds
        return "restart" if outcome == "restarted" else outcome


def log_resync(metrics: RouterMetrics, pod: str, reason: str, detail: str) -> None:
    """Count one resync and say so at info."""
    healing_metrics(metrics).resyncs.labels(pod, reason).inc()
    log.info("pod %s: index resync (%s): %s", pod, reason, detail)


def process_start(page: str) -> float | None:
    """The page's ``process_start_time_seconds`` (None: absent or unreadable)."""
    try:
        found = metrics_text.values(metrics_text.parse(page, only=(START_METRIC,)), START_METRIC)
    except ValueError:
        return None
    return found[0] if found else None


def restarted(state, page: str) -> bool:
    """Whether the pod of ``state`` (a scraped PodState) started anew since the last page
    that told its start time (remembered on ``state``)."""
    start = process_start(page)
    if start is None:
        return False
    before = getattr(state, "process_start", None)
    state.process_start = start
    return before is not None and before != start


def resubscribe(router: Router, name: str) -> None:
    """A pod restarted unseen: drop its entries and follow its events anew (blocking)."""
    log_resync(router.metrics, name, "restart", "its process start time changed")
    router.set_health(name, False)
    router.set_health(name, True)
