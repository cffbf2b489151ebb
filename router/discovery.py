"""Pod discovery: a static ``--endpoint`` list, or Kubernetes Pods by label selector."""

from __future__ import annotations

import logging
import threading

from epdserve.router.pods import PodEndpoint
from epdserve.router.service import Router

log = logging.getLogger(__name__)


class StaticDiscovery:
    """A fixed list of pods, added once at start."""

    def __init__(self, endpoints: list[PodEndpoint]) -> None:
        self.endpoints = endpoints

    def start(self, router: Router) -> None:
        """Add every pod."""
        for endpoint in self.endpoints:
            router.add_pod(endpoint)

    def stop(self) -> None:
        """Nothing to stop."""


def parse_selector(selector: str) -> list[tuple[str, str, str | None]]:
    """``a=b,c!=d,e`` as (key, op, value) terms (equality-based selectors only)."""
    terms = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        for op in ("!=", "==", "="):
            key, sep, value = term.partition(op)
            if sep:
                terms.append((key.strip(), "!=" if op == "!=" else "=", value.strip()))
                break
        else:
            terms.append((term, "exists", None))
    return terms


def selector_matches(terms: list[tuple[str, str, str | None]], labels: dict | None) -> bool:
    """Whether labels satisfy every term (re-checked locally: cheap and defensive)."""
    labels = labels or {}
    for key, op, value in terms:
        if op == "exists" and key not in labels:
            return False
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
    return True


def pod_is_ready(pod) -> bool:
    """Running, has an IP, not terminating, and its Ready condition is True."""
    status, meta = pod.status, pod.metadata
    if meta.deletion_timestamp is not None or status is None or not status.pod_ip:
        return False
    if status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))


RELIST_S = 15.0


class KubernetesDiscovery:
    """Watches Pods matching ``selector`` in ``namespace``; ready pods are routed to.

    Each watch lasts ``relist_s`` (server-side timeout) and is followed by a fresh LIST, so a
    watch that goes silent without an error (a proxy or load balancer dropping the stream, a
    lost event) leaves the routed pods stale for at most about ``relist_s`` + 5 s: the client
    also drops a stream that sends nothing for that long."""

    def __init__(
        self,
        namespace: str,
        selector: str,
        target_port: int,
        events_port: int,
        replay_port: int | None,
        resync_backoff: float = 2.0,
        kubeconfig: str | None = None,
        relist_s: float = RELIST_S,
    ) -> None:
        self.namespace, self.selector = namespace, selector
        self.kubeconfig = kubeconfig
        self._terms = parse_selector(selector)
        self.target_port, self.events_port, self.replay_port = target_port, events_port, replay_port
        self.resync_backoff = resync_backoff
        self.relist_s = relist_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch = None
        self._api = None
        self._known: dict[str, str] = {}  # k8s pod name -> router pod name
        self._listed = False
        self.errors = 0
        self.missed = 0  # relists that found changes the watch had not delivered

    def start(self, router: Router) -> None:
        """Start the list+watch thread."""
        self._thread = threading.Thread(
            target=self._run, args=(router,), name="k8s-discovery", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (pods stay as they are)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._api is not None:  # unblock a watch waiting for the next event
            self._api.api_client.rest_client.pool_manager.clear()
        if self._thread is not None:
            self._thread.join(5)

    def _client(self):
        from kubernetes import client, config

        if self.kubeconfig:
            return client.CoreV1Api(config.new_client_from_config(config_file=self.kubeconfig))
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client.CoreV1Api()

    def _run(self, router: Router) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                api = self._api = self._api or self._client()
                listing = api.list_namespaced_pod(
                    self.namespace, label_selector=self.selector, _request_timeout=10
                )
                self._sync(router, listing.items)
                self._watch = watch.Watch()
                for event in self._watch.stream(
                    api.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=max(1, round(self.relist_s)),
                    _request_timeout=(
                        10,
                        self.relist_s + min(5.0, self.relist_s),
                    ),  # silent: dropped
                ):
                    if self._stop.is_set():
                        break
                    self._on_event(router, event["type"], event["object"])
            except Exception as exc:  # API down, expired watch: count, back off, relist
                if self._stop.is_set():
                    break
                self.errors += 1
                router.metrics.client_errors.labels("discovery").inc()
                log.warning("kubernetes discovery: %s; relisting", exc)
                self._stop.wait(self.resync_backoff)

    def _endpoint(self, pod) -> PodEndpoint:
        return PodEndpoint.from_url(
            f"http://{pod.status.pod_ip}:{self.target_port}", self.events_port, self.replay_port
        )

    def _sync(self, router: Router, pods) -> None:
        present = {
            p.metadata.name for p in pods if selector_matches(self._terms, p.metadata.labels)
        }
        before = dict(self._known)
        for name in list(self._known):
            if name not in present:
                router.remove_pod(self._known.pop(name))
        for pod in pods:
            self._on_event(router, "MODIFIED", pod)
        if self._listed and before != self._known:
            self.missed += 1
            log.info(
                "kubernetes discovery: the relist changed the routed pods (%d -> %d): the watch "
                "had not delivered every change",
                len(before),
                len(self._known),
            )
        self._listed = True

    def _on_event(self, router: Router, kind: str, pod) -> None:
        name = pod.metadata.name
        wanted = selector_matches(self._terms, pod.metadata.labels)
        if kind != "DELETED" and wanted and pod_is_ready(pod):
            endpoint = self._endpoint(pod)
            old = self._known.get(name)
            if old is not None and old != endpoint.name:
                router.remove_pod(old)
            self._known[name] = endpoint.name
            router.add_pod(endpoint)
        elif name in self._known:
            router.remove_pod(self._known.pop(name))


class RoleDiscovery:
    """Several discoveries, each feeding its own router (one per pod role)."""

    def __init__(self, pairs: list) -> None:
        self.pairs = pairs  # [(router, discovery)]

    def start(self, _router=None) -> None:
        for router, discovery in self.pairs:
            discovery.start(router)

    def stop(self) -> None:
        for _, discovery in self.pairs:
            discovery.stop()
