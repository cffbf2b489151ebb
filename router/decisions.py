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

from epdserve.router.strategy import uncached_tokens

if TYPE_CHECKING:
    from epdserve.router.pods import PodState
    from epdserve.router.service import Router, Routing

log = logging.getLogger(__name__)
DEFAULT_STORE_COST = 0.1
SPREAD_REASONS = {"spread": "cost", "load_balance": "balance"}


def start_prefill(router: Router, pod: PodState, routing: Routing) -> float:
    """Add the request's work to ``pod``'s backlog; returns it for :func:`end_prefill`."""
    size = routing.block_size.get(pod.name, 0)
    work = uncached_tokens(
        routing.prompt_tokens,
        size,
        routing.matched.get(pod.name, 0),
        routing.store.get(pod.name, 0),
        getattr(router.strategy, "store_cost", DEFAULT_STORE_COST),
    )
    pod.prefilling += 1
    pod.prefill_tokens += work
    router.metrics.prefill_backlog.labels(pod.name).set(pod.prefill_tokens)
    return work


def end_prefill(router: Router, pod: PodState, work: float) -> None:
    """The request's first byte came back from ``pod`` (or the attempt ended without)."""
    pod.prefilling = max(0, pod.prefilling - 1)
    pod.prefill_tokens = max(0.0, pod.prefill_tokens - work) if pod.prefilling else 0.0
    router.metrics.prefill_backlog.labels(pod.name).set(pod.prefill_tokens)


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
