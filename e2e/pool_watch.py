"""Observers of a running P/D pool, for the elastic scenario (test_elastic.py): the decode
role's replica timeline and every engine pod's prefix-cache counters (`Watch`), what the
decode pods that left logged about draining, and the routers' prefix and index metrics.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
from pools_e2e import NS, ready_pod_ips

from epdserve.common import metrics_text


class Watch:
    """Samples the decode Deployment, ready pods and every engine pod's cache counters each
    second; a pod's last sample is kept after it leaves (its counters go with it)."""

    def __init__(self, cluster, name: str):
        self.cluster, self.name = cluster, name
        self.t0 = time.monotonic()
        self.timeline: list[dict] = []
        self.counters: dict[str, dict] = {}  # pod -> role and last counter values
        self.decode_pods: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)

    def decode_ready(self) -> int:
        return len(ready_pod_ips(self.cluster, self.selector("decode")))

    def selector(self, role: str) -> str:
        """The label selector of this pool's pods of one role."""
        return f"epdserve.io/pool={self.name},epdserve.io/role={role}"

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.sample()
            except Exception:  # an API hiccup: the next second samples again
                continue

    def sample(self) -> None:
        dep = self.cluster.api.get("Deployment", NS, f"{self.name}-decode") or {}
        pods = self.cluster.pods(NS, self.selector("decode"))
        self.decode_pods.update(p["metadata"]["name"] for p in pods)
        point = {
            "t": round(time.monotonic() - self.t0, 1),
            "desired": (dep.get("spec") or {}).get("replicas"),
            "ready": self.decode_ready(),
            "terminating": sum(1 for p in pods if p["metadata"].get("deletionTimestamp")),
        }
        last = self.timeline[-1] if self.timeline else {}
        if {k: last.get(k) for k in ("desired", "ready", "terminating")} != {
            k: point[k] for k in ("desired", "ready", "terminating")
        }:
            self.timeline.append(point)
        for role in ("prefill", "decode"):
            for ip in ready_pod_ips(self.cluster, self.selector(role)):
                try:
                    text = httpx.get(f"http://{ip}:8000/metrics", timeout=3).text
                except httpx.HTTPError:
                    continue
                page = metrics_text.parse(text)
                self.counters[ip] = {"role": role} | {  # queries, hits, external_queries, ...
                    f"{ext}{what}": metrics_text.total(page, f"vllm:{ext}prefix_cache_{what}_total")
                    for ext in ("", "external_")
                    for what in ("queries", "hits")
                }

    def hit_rates(self) -> dict:
        """Per role: local prefix-cache hit rate, and local + shared-store hits over queries."""
        out = {}
        for role in ("prefill", "decode"):
            rows = [c for c in self.counters.values() if c["role"] == role]
            queries = sum(r["queries"] for r in rows)
            hits = sum(r["hits"] for r in rows)
            external = sum(r["external_hits"] for r in rows)
            out[role] = {
                "local": round(hits / queries, 4) if queries else None,
                "local_or_store": round((hits + external) / queries, 4) if queries else None,
                "prompt_tokens": int(queries),
            }
        return out


def drains(cluster, pods: set[str]) -> list[dict]:
    """What each decode pod that left logged: requests in flight at SIGTERM, clean end."""
    out = []
    for pod in sorted(pods):
        log = cluster.log(NS, pod)
        if match := re.search(r"draining: SIGTERM; (\d+) request", log):
            out.append({"in_flight": int(match.group(1)), "drained": "drained: shut down" in log})
    return out


def router_view(cluster, name: str) -> dict:
    """The routers' matched / total prompt blocks over their decisions, and their index's
    blocks per tier (store: announced by the pods' saves to Redis, over ZMQ)."""
    matched = total = 0.0
    tiers = {"local": 0.0, "store": 0.0}
    for ip in ready_pod_ips(cluster, f"epdserve.io/router={name}"):
        page = metrics_text.parse(httpx.get(f"http://{ip}:8000/metrics", timeout=10).text)
        decided = "epdserve_router:decision_prefix_blocks_total"
        matched += metrics_text.total(page, decided, kind="matched")
        total += metrics_text.total(page, decided, kind="total")
        for tier in tiers:
            tiers[tier] += metrics_text.total(page, "epdserve_router:index_blocks", tier=tier)
    return {"prefix_ratio": round(matched / total, 4) if total else None, "index_blocks": tiers}
