"""The resync loop: periodic drift repair and status refresh for every pool.

kopf timers would force a finalizer onto every pool; a finalizer-free operator is simpler to
delete and uninstall, so the periodic work runs as one background task started at operator
startup. Child Deployment events (see main.child_changed) wake it early for their pool.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
import os
import threading

from epdserve.operator.autoscaler import Autoscaler, safe_step
from epdserve.operator.kube import ApiError, Kube, object_path
from epdserve.operator.reconcile import Outcome, reconcile
from epdserve.operator.spec import GROUP, KIND, PLURAL, VERSION

logger = logging.getLogger("epdserve.operator.resync")
API_VERSION = f"{GROUP}/{VERSION}"
RECHECK_SECONDS = 1.0  # a pool whose endpoint trails its Deployments: look again this soon


def now() -> str:
    """RFC 3339 UTC timestamp, second precision (what conditions carry)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def watched_namespaces() -> list[str]:
    """Namespaces from $EPDSERVE_WATCH_NAMESPACES (empty: the whole cluster)."""
    return [n for n in os.environ.get("EPDSERVE_WATCH_NAMESPACES", "").split(",") if n]


class Resyncer:
    """Serialises reconciles per pool and runs the periodic pass in a worker thread."""

    def __init__(self, kube: Kube, interval: float, autoscaler: Autoscaler | None = None):
        self.kube = kube
        self.interval = interval
        self.autoscaler = autoscaler  # runs after each reconcile of a pool; None: off
        self.locks: dict[tuple[str, str], threading.Lock] = collections.defaultdict(threading.Lock)
        self.dirty: set[tuple[str, str]] = set()
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def lock(self, namespace: str, name: str) -> threading.Lock:
        """The lock that keeps two reconciles of one pool from interleaving."""
        return self.locks[namespace, name]

    def mark(self, namespace: str, name: str) -> None:
        """Ask for a prompt resync of one pool (call from the operator's event loop)."""
        self.dirty.add((namespace, name))
        self.wakeup.set()

    def mark_later(self, namespace: str, name: str, delay: float = RECHECK_SECONDS) -> None:
        """Ask for a resync of one pool after `delay` seconds (call from any thread)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, delay, self.mark, namespace, name)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = self.loop.create_task(self._run(), name="epdserve-resync")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_full = loop.time() + self.interval
        while True:
            try:
                await asyncio.wait_for(self.wakeup.wait(), max(0.0, next_full - loop.time()))
                await asyncio.sleep(0.2)  # let a burst of child events coalesce
            except TimeoutError:
                pass
            self.wakeup.clear()
            full = loop.time() >= next_full  # a full pass at least every interval
            only, self.dirty = (None if full else set(self.dirty)), set()
            if full:
                next_full = loop.time() + self.interval
            elif not only:
                continue
            try:
                await asyncio.to_thread(self.resync, only)
            except Exception:  # never let the loop die; the next pass retries
                logger.exception("resync pass failed")

    def pools(self, only: set | None) -> list[dict]:
        """The pools to resync: the marked ones, or all in the watched namespaces."""
        if only is not None:
            found = (self.kube.get(API_VERSION, KIND, ns, name) for ns, name in sorted(only))
            return [p for p in found if p]
        namespaces = watched_namespaces() or [None]
        items = []
        for ns in namespaces:
            path = object_path(API_VERSION, KIND, ns) if ns else f"/apis/{API_VERSION}/{PLURAL}"
            items += self.kube.request("GET", path).get("items") or []
        return items

    def resync(self, only: set | None = None) -> None:
        """One pass over the pools: reconcile, write changed status, post events."""
        for body in self.pools(only):
            meta = body["metadata"]
            with self.lock(meta["namespace"], meta["name"]):
                outcome = reconcile(self.kube, body, now(), announce=False)
                if outcome.retry is None:
                    scaled, events = safe_step(self.autoscaler, body, now())
                    if scaled:
                        outcome.status["autoscaling"] = scaled
                    outcome.events += events
            self.report(body, outcome)
            if outcome.recheck:
                self.mark_later(meta["namespace"], meta["name"])

    def report(self, body: dict, outcome: Outcome) -> None:
        """Write the status if it changed and post the outcome's events."""
        meta = body["metadata"]
        if outcome.retry == "temporary":
            logger.warning("pool %s/%s: %s", meta["namespace"], meta["name"], outcome.error)
        if outcome.status and outcome.status != (body.get("status") or {}):
            path = object_path(API_VERSION, KIND, meta["namespace"], meta["name"]) + "/status"
            try:
                self.kube.request(
                    "PATCH",
                    path,
                    body={"status": outcome.status},
                    content_type="application/merge-patch+json",
                )
            except ApiError as exc:  # 404: deleted meanwhile; others: next pass
                logger.info("status of %s not written: %s", meta["name"], exc)
        for etype, reason, message in outcome.events:
            post_event(self.kube, body, etype, reason, message)


def post_event(kube: Kube, body: dict, etype: str, reason: str, message: str) -> None:
    """A core/v1 Event about the pool (best effort: an Event is never worth a failure)."""
    meta = body["metadata"]
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": etype,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "epdserve-operator"},
        "firstTimestamp": now(),
        "lastTimestamp": now(),
        "count": 1,
    }
    try:
        kube.create(event)
    except ApiError as exc:
        logger.info("event %s not posted: %s", reason, exc)
