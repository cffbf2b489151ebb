"""The router's own view of each pod's queue, and what each routing decision did.

Prefill backlog: a request sent to a pod adds the prompt tokens the pod must compute there
(the prompt less the blocks it has cached; blocks loadable from the pool's shared store at
``store_cost`` of a computed one) to the pod's backlog, and takes them off when the pod's
first byte comes back (a stream's first token; a whole answer otherwise) or the attempt
fails. Unlike a ``/metrics`` scrape, this is current to the request; ``prefix+cost`` ranks
pods by it.

Decisions: every routed request counts its blocks on the chosen pod by tier, whether that
pod held the longest cached prefix of any pod, and, when it did not, why (a metric per
reason); each decision is one log line at debug.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from epdserve.router.strategy import Candidate, uncached_tokens

if TYPE_CHECKING:
    from epdserve.router.pods import PodState
    from epdserve.router.service import Router, Routing

log = logging.getLogger(__name__)
DEFAULT_STORE_COST = 0.1
SPREAD_REASONS = {"spread": "cost", "load_balance": "balance"}


class Charge:
    """A request's work on one pod's backlog: charged to the first-ranked pod when it is
    routed (so a burst of requests routed together sees each other's work), moved to the
    pod an attempt goes to, and released at that pod's first byte, when the attempt fails,
    or, whatever happens to the request, when its routing is dropped."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self.pod: PodState | None = None
        self.work = 0.0

    def move_to(self, pod: PodState | None, routing: Routing) -> None:
        """Charge ``pod`` (None: nobody) instead of the pod charged now."""
        with self._router.charge_lock:
            if pod is self.pod:
                return
            if self.pod is not None and pod is not None:  # it will not compute there after all
                self._router.pending.discard(self.pod.name, routing.keys.get(self.pod.name, []))
            self._release()
            if pod is not None:
                self.pod, self.work = pod, work_on(self._router, pod.name, routing)
                pod.prefilling += 1
                pod.prefill_tokens += self.work
                self._router.metrics.prefill_backlog.labels(pod.name).set(pod.prefill_tokens)

    def release(self) -> None:
        with self._router.charge_lock:
            self._release()

    def _release(self) -> None:
        pod, self.pod = self.pod, None
        if pod is not None:
            pod.prefilling = max(0, pod.prefilling - 1)
            pod.prefill_tokens = max(0.0, pod.prefill_tokens - self.work) if pod.prefilling else 0.0
            self._router.metrics.prefill_backlog.labels(pod.name).set(pod.prefill_tokens)


def candidate(router: Router, pod: PodState, routing: Routing, affinity: dict) -> Candidate:
    """``pod`` as the strategy sees it for the routed request."""
    return Candidate(
        pod.name,
        pod.load(),
        pod.kv_usage,
        routing.matched.get(pod.name, 0),
        routing.total_blocks.get(pod.name, 0),
        router.index.pod_block_count(pod.name),
        routing.store.get(pod.name, 0),
        affinity.get(pod.name, 0),
        routing.prompt_tokens,
        routing.block_size.get(pod.name, 0),
        pod.prefill_tokens,
        max(0, pod.inflight - pod.prefilling),
    )


def work_on(router: Router, pod: str, routing: Routing) -> float:
    """The prompt tokens ``pod`` must compute for the routed request (store loads at the
    strategy's ``store_cost``)."""
    return uncached_tokens(
        routing.prompt_tokens,
        routing.block_size.get(pod, 0),
        routing.matched.get(pod, 0),
        routing.store.get(pod, 0),
        getattr(router.strategy, "store_cost", DEFAULT_STORE_COST),
    )


def record_decision(router: Router, routing: Routing, pod: str, attempt: int) -> None:
    """Metrics and the debug line for the pod a request finally went to."""
    metrics = router.metrics
    total = routing.total_blocks.get(pod, 0)
    local = routing.matched.get(pod, 0)
    store = min(routing.store.get(pod, 0), max(0, total - local))
    if total:
        metrics.decision_blocks.labels("local").inc(local)
        metrics.decision_blocks.labels("store").inc(store)
        metrics.decision_blocks.labels("miss").inc(max(0, total - local - store))
    best_pod, best = max(routing.matched.items(), key=lambda kv: kv[1], default=(None, 0))
    first = routing.order[0].reason if routing.order else ""
    if not best:
        choice = "none"
    elif local >= best:
        choice = "best"
    else:
        choice = "other"
        why = "retry" if attempt else SPREAD_REASONS.get(first, "score")
        metrics.spread.labels(why).inc()
    metrics.best_prefix.labels(choice).inc()
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "routed to %s (%s, attempt %d): %d/%d blocks cached, %d in the store; "
            "longest prefix %d on %s; backlog %.0f tokens",
            pod,
            first if not attempt else "retry",
            attempt,
            local,
            total,
            store,
            best,
            best_pod,
            getattr(router.pod(pod), "prefill_tokens", 0.0),
        )
