"""The router's state: pods, their event subscribers, the index, and routing decisions."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import zmq

from epdserve.router.decisions import Charge, candidate, record_decision
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys
from epdserve.router.lora import AdapterLoads, AdapterPolicy
from epdserve.router.metrics import RouterMetrics
from epdserve.router.pending import PendingPrefixes
from epdserve.router.pods import PodEndpoint, PodState
from epdserve.router.processed import has_images, image_affinity, is_chat, routing_ids
from epdserve.router.seedcheck import RootHashCheck
from epdserve.router.strategy import Decision, Strategy
from epdserve.router.subscriber import EventSocketOptions, PodSubscriber
from epdserve.router.tokenize import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Routing:
    """Pods to try in order, with each pod's matched and the prompt's total blocks."""

    order: list[Decision]
    matched: dict[str, int]
    total_blocks: dict[str, int]
    keys: dict[str, list[int]]  # pod -> the prompt's block keys at that pod's block size
    lora: str | None = None  # the adapter the request names (None: the base model)
    prompt_tokens: int = 0  # the prompt's length as routed (0: not tokenized)
    store: dict[str, int] = field(default_factory=dict)  # pod -> store blocks after its local
    block_size: dict[str, int] = field(default_factory=dict)  # pod -> its block size
    charge: Charge | None = None  # its work on a pod's backlog (router/decisions.py)


class Router:
    """Owns the pods the router knows; thread-safe add/remove (discovery threads)."""

    def __init__(
        self,
        strategy: Strategy,
        tokenizer: PromptTokenizer | None,
        served_model_name: str | None = None,
        index: PrefixIndex | None = None,
        metrics: RouterMetrics | None = None,
        subscribe: bool = True,
        speculative_ttl: float = 2.0,
        default_block_size: int = 16,
        root_check: RootHashCheck | None = None,
        engine_role: str = "colocated",
        event_options: EventSocketOptions | None = None,
        lora_policy: AdapterPolicy | None = None,
    ) -> None:
        self.strategy, self.tokenizer = strategy, tokenizer
        self._event_options = event_options  # Curve keys and size bound of event sockets
        self.engine_role = engine_role  # which of the pool's pods this router routes to
        self.served_model_name = served_model_name
        self.lora_policy = lora_policy or AdapterPolicy()  # adapters: see router/lora.py
        self.adapter_loads = AdapterLoads(self.lora_policy.retry_s)
        self.index = index or PrefixIndex()
        self.metrics = metrics or RouterMetrics()
        # shared by every role's router of a pool: prefill and decode pods must agree
        self.root_check = root_check or RootHashCheck(self.metrics)
        self._subscribe = subscribe
        self.default_block_size = default_block_size  # until a pod's events tell its own
        self.pending = PendingPrefixes(speculative_ttl)
        self._pods: dict[str, PodState] = {}
        self._subscribers: dict[str, PodSubscriber] = {}
        self._lock = threading.Lock()
        self.charge_lock = threading.RLock()  # pods' prefill backlogs (router/decisions.py)
        self._inflight_pods: set[str] = set()
        self._evicted_seen = 0
        self._zmq = zmq.Context()

    # --- pods ----------------------------------------------------------------------------

    def add_pod(self, endpoint: PodEndpoint) -> None:
        """Start routing to a pod and following its events (idempotent)."""
        with self._lock:
            if endpoint.name in self._pods:
                return
            self._pods[endpoint.name] = PodState(endpoint)
        self._start_subscriber(endpoint)
        log.info("pod %s added (%s)", endpoint.name, endpoint.url)
        self._update_pod_gauges()

    def remove_pod(self, name: str) -> None:
        """Stop routing to a pod and drop its index entries."""
        with self._lock:
            state = self._pods.pop(name, None)
        self._stop_subscriber(name)
        self.pending.remove_pod(name)
        self.root_check.forget_pod(name)
        if state is not None:
            if name in self._inflight_pods:
                self._inflight_pods.discard(name)
                self.metrics.inflight.remove(name)
            log.info("pod %s removed", name)
        self._update_pod_gauges()

    def set_health(self, name: str, healthy: bool) -> None:
        """Health checks: an unhealthy pod leaves rotation and the index; it comes back
        with a fresh subscriber (replay) when healthy again."""
        with self._lock:
            state = self._pods.get(name)
            if state is None or state.healthy == healthy:
                return
            state.healthy = healthy
        if healthy:
            state.mark_ok()
            self._start_subscriber(state.endpoint)
        else:
            self._stop_subscriber(name)
        log.warning("pod %s is now %s", name, "healthy" if healthy else "unhealthy")
        self._update_pod_gauges()

    def pods(self) -> list[PodState]:
        """A snapshot of every known pod."""
        with self._lock:
            return list(self._pods.values())

    def pod(self, name: str) -> PodState | None:
        return self._pods.get(name)

    def available(self) -> list[PodState]:
        """Pods a request may go to now."""
        now = time.monotonic()
        pods = self.pods()
        ready = [p for p in pods if p.available(now)]
        # every healthy pod backing off after a failure: better to try them than refuse
        return ready or [p for p in pods if p.healthy]

    def _start_subscriber(self, endpoint: PodEndpoint) -> None:
        if not self._subscribe:
            return
        sub = PodSubscriber(
            endpoint.name,
            endpoint.events,
            endpoint.replay,
            self.index,
            self.metrics,
            self._zmq,
            root_check=self.root_check,
            options=self._event_options,
        )
        with self._lock:
            old = self._subscribers.pop(endpoint.name, None)
            self._subscribers[endpoint.name] = sub
        if old is not None:
            old.stop()
        sub.start()

    def _stop_subscriber(self, name: str) -> None:
        with self._lock:
            sub = self._subscribers.pop(name, None)
        if sub is not None:
            sub.stop()
        self.index.remove_pod(name)

    def track_inflight(self, state: PodState, delta: int) -> None:
        """A request to ``state``'s pod started (+1) or ended (-1)."""
        state.inflight += delta
        self._inflight_pods.add(state.name)
        self.metrics.inflight.labels(state.name).set(state.inflight)

    def _update_pod_gauges(self) -> None:
        pods = self.pods()
        healthy = sum(1 for p in pods if p.healthy)
        self.metrics.pods.labels(self.engine_role, "healthy").set(healthy)
        self.metrics.pods.labels(self.engine_role, "unhealthy").set(len(pods) - healthy)

    def close(self) -> None:
        """Stop every subscriber."""
        for name in list(self._subscribers):
            self._stop_subscriber(name)
        self._zmq.destroy(linger=0)

    # --- routing -------------------------------------------------------------------------

    def prompt_ids(self, path: str, body: dict) -> list[int] | None:
        """The ids to route ``body`` by: its processed prompt's (as a pod made it), or the
        router's own tokenization when its strategy routes by prefix (None: neither)."""
        given = routing_ids(body)
        if given is not None:
            return given
        if self.tokenizer is None or not self.strategy.uses_prefix or has_images(path, body):
            return None  # image placeholders are the pods' to expand
        try:
            if is_chat(path):
                return self.tokenizer.chat_ids(body)
            if path.endswith("/completions"):
                return self.tokenizer.completion_ids(body)
            return None
        except Exception as exc:  # PromptError, template errors: route by load instead
            self.metrics.tokenize_errors.inc()
            log.debug("cannot tokenize prompt: %s", exc)
            return None

    def route(self, path: str, body: dict) -> Routing:
        """Rank the available pods for one request."""
        start = time.perf_counter()
        pods = self.available()
        ids = self.prompt_ids(path, body) if pods else None
        lora = self._lora(body)
        matched, totals, keys, loadable = self._match(pods, ids, lora, _salt(body))
        store = {n: loadable[n] - matched.get(n, 0) for n in loadable}
        sizes = {p.name: self.index.block_size(p.name) or self.default_block_size for p in pods}
        affinity = image_affinity(body, [p.name for p in pods]) if self.strategy.uses_images else {}
        charge = Charge(self)
        routing = Routing([], matched, totals, keys, lora, len(ids or ()), store, sizes, charge)
        with self.charge_lock:  # rank and charge as one: a burst sees each other's work
            routing.order.extend(
                self.strategy.rank([candidate(self, p, routing, affinity) for p in pods])
            )
            if routing.order and self.strategy.uses_prefix:
                first = routing.order[0].pod
                charge.move_to(self._pods.get(first), routing)
                weakref.finalize(routing, charge.release)
                self.pending.add(first, keys.get(first, []))  # a burst sees it (pending.py)
        self.metrics.decision_latency.observe(time.perf_counter() - start)
        return routing

    def _lora(self, body: dict) -> str | None:
        """The adapter ``body`` names: any model but the served one, or without a served
        name, one the router may load or a pod lists."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return None
        if self.served_model_name:
            return model if model != self.served_model_name else None
        known = model in self.lora_policy.sources
        return model if known or any(p.adapters.holds(model) for p in self.pods()) else None

    def _match(
        self, pods: list[PodState], ids: list[int] | None, lora: str | None, salt: str | None
    ):
        if not ids:
            return {}, {}, {}, {}
        # pods key a prompt alike when they share a block size and the adapter's version
        groups: dict[tuple[int, str | None], list[str]] = {}
        for p in pods:
            size = self.index.block_size(p.name) or self.default_block_size
            digest = self.index.lora_digest(p.name, lora) if lora else None
            groups.setdefault((size, digest), []).append(p.name)
        matched: dict[str, int] = {}
        totals: dict[str, int] = {}
        pod_keys: dict[str, list[int]] = {}
        loadable: dict[str, int] = {}  # local or shared-store prefix (>= matched)
        for (size, digest), names in groups.items():
            keys = request_keys(ids, size, lora, salt, digest)
            found = self.index.match_tiers(keys, names)
            expected = self.pending.match(keys, names)
            matched.update({n: max(found[n][0], expected[n]) for n in names})
            loadable.update({n: max(found[n][1], matched[n]) for n in names})
            totals.update(dict.fromkeys(names, len(keys)))
            pod_keys.update(dict.fromkeys(names, keys))
        return matched, totals, pod_keys, loadable

    def record(self, routing: Routing, pod: str, attempt: int) -> None:
        """Metrics for the pod a request finally went to."""
        first = routing.order[0] if routing.order else None
        reason = first.reason if first and attempt == 0 else "retry"
        self.metrics.requests.labels(pod, reason).inc()
        record_decision(self, routing, pod, attempt)
        self.pending.add(pod, routing.keys.get(pod, []))
        total = routing.total_blocks.get(pod, 0)
        if total:
            hit = routing.matched.get(pod, 0)
            self.metrics.prefix_hit_ratio.observe(hit / total)
            self.metrics.prefix_blocks.labels("matched").inc(hit)
            self.metrics.prefix_blocks.labels("total").inc(total)
        self.update_index_gauges()
        evicted = self.index.evicted
        if evicted > self._evicted_seen:
            self.metrics.index_evictions.inc(evicted - self._evicted_seen)
            self._evicted_seen = evicted

    def update_index_gauges(self) -> None:
        """``index_blocks{engine_role,tier}`` from the index now."""
        for tier, n in self.index.tier_block_counts().items():
            self.metrics.index_blocks.labels(self.engine_role, tier).set(n)


def _salt(body: dict) -> str | None:
    """The request's ``cache_salt`` (tenant isolation); a malformed one is the engine's to
    reject, so it routes as unsalted."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None
