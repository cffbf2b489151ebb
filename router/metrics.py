"""The router's Prometheus metrics (``epdserve_router:*``), on their own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "epdserve_router:"
LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1, 1.0)
RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class RouterMetrics:
    """Every metric the router exports; one instance per router (and per test)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            P + "requests",
            "Requests routed, by pod and routing reason",
            ["pod", "reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            P + "upstream_errors",
            "Upstream failures before streaming, by pod and kind (pod failures by cause)",
            ["pod", "kind"],
            registry=r,
        )
        self.upstream_retries = Counter(
            P + "upstream_retries",
            "Requests sent on to the next ranked pod after a pod failure, by cause",
            ["cause"],
            registry=r,
        )
        self.client_errors = Counter(
            P + "request_failures",
            "Requests answered with a router error, by reason",
            ["reason"],
            registry=r,
        )
        # engine_role: the pods one of the router's per-role routers routes to (colocated,
        # prefill, decode, encoder); not `role`, which scrapes attach from the router pod
        self.pods = Gauge(
            P + "pods", "Known pods by engine role and state", ["engine_role", "state"], registry=r
        )
        self.inflight = Gauge(
            P + "inflight_requests", "Requests in flight per pod", ["pod"], registry=r
        )
        self.index_blocks = Gauge(
            P + "index_blocks",
            "Blocks held by the prefix index, summed over pods, by tier (local: a pod's own "
            "cache; store: the pool's shared store) and engine role",
            ["engine_role", "tier"],
            registry=r,
        )
        self.index_evictions = Counter(
            P + "index_evictions", "Keys dropped by the index capacity bound", registry=r
        )
        self.events_received = Counter(
            P + "kv_events_received",
            "KV events applied, by pod and type",
            ["pod", "type"],
            registry=r,
        )
        self.events_missed = Counter(
            P + "kv_event_batches_missed",
            "Event batches (seq numbers) lost and not replayed",
            ["pod"],
            registry=r,
        )
        self.events_invalid = Counter(
            P + "kv_event_batches_invalid",
            "Event messages that could not be decoded",
            ["pod"],
            registry=r,
        )
        self.blocks_unindexed = Counter(
            P + "kv_blocks_unindexed",
            "Stored blocks not indexed, by reason",
            ["pod", "reason"],
            registry=r,
        )
        self.hash_seed_mismatches = Counter(
            P + "hash_seed_mismatches",
            "First blocks this pod stored under another engine hash than another pod did "
            "(a different --hash-seed or hash algorithm: no KV sharing between them)",
            ["pod"],
            registry=r,
        )
        self.replays = Counter(
            P + "kv_event_replays", "Replay requests, by outcome", ["pod", "outcome"], registry=r
        )
        self.decision_latency = Histogram(
            P + "routing_decision_seconds",
            "Time to pick a pod (tokenize + lookup + score)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_hit_ratio = Histogram(
            P + "decision_prefix_hit_ratio",
            "Matched fraction of the prompt's blocks on the chosen pod",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.prefix_blocks = Counter(
            P + "decision_prefix_blocks",
            "Prompt blocks of routed requests, by matched or total",
            ["kind"],
            registry=r,
        )
        self.decision_blocks = Counter(
            P + "decision_blocks",
            "Prompt blocks of routed requests on the chosen pod, by tier: in its own cache "
            "(local), loadable from the pool's shared store (store) or neither (miss)",
            ["tier"],
            registry=r,
        )
        self.best_prefix = Counter(
            P + "decision_best_prefix",
            "Routed requests by whether the chosen pod held the longest cached prefix of any "
            "pod (best), another pod did (other), or no pod held any (none)",
            ["choice"],
            registry=r,
        )
        self.spread = Counter(
            P + "spread_decisions",
            "Requests sent away from the pod with the longest cached prefix, by why: its queue "
            "outweighed a recompute or a store load elsewhere (cost), it was too busy "
            "(balance), or it failed or was busy (retry)",
            ["reason"],
            registry=r,
        )
        self.prefill_backlog = Gauge(
            P + "prefill_backlog_tokens",
            "Prompt tokens of requests sent to the pod that have no first byte back yet, less "
            "those cached where they were routed (the router's estimate)",
            ["pod"],
            registry=r,
        )
        self.tokenize_errors = Counter(
            P + "tokenize_errors",
            "Prompts that could not be tokenized (routed by load)",
            registry=r,
        )
        self.lora_requests = Counter(
            P + "lora_requests",
            "Requests (legs, in a P/D pool) routed to a pod holding or loading the adapter "
            "they name, by engine role and adapter",
            ["engine_role", "lora_name"],
            registry=r,
        )
        self.lora_loads = Counter(
            P + "lora_loads",
            "Adapter loads the router asked pods for, by adapter and outcome (loaded, failed)",
            ["lora_name", "outcome"],
            registry=r,
        )
        self.scrape_errors = Counter(
            P + "scrape_errors", "Failed pod metric scrapes", ["pod"], registry=r
        )

        for tier in ("local", "store", "miss"):  # every series from the start: rate() is 0
            self.decision_blocks.labels(tier)
        for choice in ("best", "other", "none"):
            self.best_prefix.labels(choice)
        for why in ("cost", "balance", "score", "retry"):
            self.spread.labels(why)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
