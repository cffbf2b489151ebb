"""The operator's own autoscaling loop (`spec.autoscaling.engine: operator`).

Each pass reads every autoscaled role's ready pods' `/metrics`, decides with
:func:`autoscaling.desired_replicas`, sets the role Deployment's `spec.replicas`, and returns
the per-role status. The reconcile keeps whatever replicas the Deployment has (within the
bounds), so the two never fight. The scraper is injectable: tests pass a fake metrics source.
"""

from __future__ import annotations

import collections
import logging
import time
import urllib.request
from collections.abc import Callable

from epdserve.common import metrics_text
from epdserve.operator import autoscaling as scaling
from epdserve.operator import meta
from epdserve.operator.kube import ApiError, Kube, object_path
from epdserve.operator.spec import InvalidSpec, PoolSpec, parse_pool

logger = logging.getLogger("epdserve.operator.autoscaler")
TTFT = scaling.METRICS["ttftP90"]
MERGE = "application/merge-patch+json"


def http_scrape(url: str) -> str:
    """The text of one pod's /metrics (short timeout: a slow pod must not stall the pass)."""
    with urllib.request.urlopen(url, timeout=2.0) as response:  # noqa: S310 (pod IPs only)
        return response.read().decode()


def ready_pod_ips(pods: list[dict]) -> list[tuple[str, str]]:
    """(pod name, IP) of the running, ready pods that are not being deleted."""
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            out.append((pod["metadata"]["name"], status["podIP"]))
    return out


class Autoscaler:
    """Scaling state across passes: recommendation histories and last TTFT histograms."""

    def __init__(
        self,
        kube: Kube,
        scrape: Callable[[str], str] = http_scrape,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.kube = kube
        self.scrape = scrape
        self.clock = clock
        self.history: dict[tuple, list] = collections.defaultdict(list)
        self.last_buckets: dict[tuple, dict[str, dict]] = {}
        self.scrape_errors = 0  # counted, logged; a pod that fails is left out of the mean

    def step(self, body: dict, now: str) -> tuple[dict, list[tuple[str, str, str]]]:
        """One pass over a pool: (status.autoscaling, events). Empty when nothing autoscales."""
        try:
            pool = parse_pool(body)
        except InvalidSpec:
            return {}, []  # the reconcile reports it
        if pool.autoscaling.engine != "operator":
            return {}, []
        old = (body.get("status") or {}).get("autoscaling") or {}
        status, events = {}, []
        for role, spec in pool.roles.items():
            if spec.autoscaling is None:
                continue
            entry = self.step_role(pool, role, spec.autoscaling, old.get(role) or {}, now)
            if entry is None:
                continue
            if entry.get("lastScaleTime") == now != (old.get(role) or {}).get("lastScaleTime"):
                events.append(("Normal", "Scaled", f"{role}: {entry['lastScaleReason']}"))
            status[role] = entry
        return status, events

    def step_role(self, pool: PoolSpec, role: str, policy, old: dict, now: str) -> dict | None:
        """Decide and apply one role's size; its status entry (None: no Deployment yet)."""
        name = meta.name_of(pool, role)
        deployment = self.kube.get("apps/v1", "Deployment", pool.namespace, name)
        if deployment is None:
            return None
        current = int((deployment.get("spec") or {}).get("replicas", 1))
        values = self.measure(pool, role, policy.metric)
        key = (pool.namespace, pool.name, role)
        decision = scaling.desired_replicas(
            current, values, policy, self.history[key], self.clock()
        )
        entry = {
            "desiredReplicas": decision.replicas,
            "currentReplicas": current,
            **{k: old[k] for k in ("lastScaleTime", "lastScaleReason") if k in old},
        }
        if decision.replicas != current:
            path = object_path("apps/v1", "Deployment", pool.namespace, name)
            patch = {"spec": {"replicas": decision.replicas}}
            self.kube.request("PATCH", path, body=patch, content_type=MERGE)
            entry.update(lastScaleTime=now, lastScaleReason=decision.reason)
        return entry

    def measure(self, pool: PoolSpec, role: str, metric: str) -> list[float]:
        """The metric of each ready pod (TTFT: one p90 over the pods' new observations)."""
        selector = f"{meta.POOL_LABEL}={pool.name},{meta.ROLE_LABEL}={role}"
        pods = ready_pod_ips(self.kube.list("v1", "Pod", pool.namespace, selector))
        pages = {}
        for pod, ip in pods:
            try:
                pages[pod] = metrics_text.parse(
                    self.scrape(f"http://{ip}:{meta.HTTP_PORT}/metrics")
                )
            except Exception as exc:  # unreachable, slow or unreadable pod: counted, left out
                self.scrape_errors += 1
                logger.info("metrics of %s not read: %s", pod, exc)
        if metric != "ttftP90":
            values = (scaling.pod_value(page, metric) for page in pages.values())
            return [v for v in values if v is not None]
        key = (pool.namespace, pool.name, role)
        before = self.last_buckets.get(key, {})
        now = {pod: metrics_text.buckets(page, TTFT) for pod, page in pages.items()}
        self.last_buckets[key] = now
        merged: dict[float, float] = {}
        for pod, counts in now.items():
            for bound, count in scaling.histogram_delta(counts, before.get(pod)).items():
                merged[bound] = merged.get(bound, 0.0) + count
        p90 = scaling.quantile(0.9, merged)
        return [] if p90 is None else [p90]


def held_replicas(pool: PoolSpec, live: dict) -> dict[str, int]:
    """Replicas of each autoscaled role for the builders: the live Deployment's (the
    autoscaler's last decision, or the HPA's), clamped to the bounds; minReplicas at first."""
    out = {}
    for role, spec in pool.roles.items():
        policy = spec.autoscaling
        if policy is None:
            continue
        deployment = live.get(("Deployment", meta.name_of(pool, role)))
        have = ((deployment or {}).get("spec") or {}).get("replicas")
        have = policy.min_replicas if have is None else int(have)
        out[role] = min(max(have, policy.min_replicas), policy.max_replicas)
    return out


def safe_step(autoscaler: Autoscaler | None, body: dict, now: str):
    """Autoscaler.step that never raises (an API error waits for the next pass)."""
    if autoscaler is None:
        return {}, []
    try:
        return autoscaler.step(body, now)
    except ApiError as exc:
        logger.warning("autoscaling %s: %s", body["metadata"].get("name"), exc)
        return {}, []
