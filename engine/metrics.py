"""Prometheus metrics under vLLM's names (so dashboards, KEDA and routers work) + ``epdserve:*``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epdserve.engine.core.interfaces import SchedulerStats

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name", "engine"]
        self.labels = {"model_name": model_name, "engine": "0"}

        def g(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(**self.labels)

        def c(name, doc, extra=()):
            metric = Counter(name, doc, labels + list(extra), registry=r)
            return metric if extra else metric.labels(**self.labels)

        def h(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**self.labels)

        self.running = g(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = c("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.ext_queries = c(
            "vllm:external_prefix_cache_queries", "External prefix cache queries, in tokens."
        )
        self.ext_hits = c(
            "vllm:external_prefix_cache_hits", "External prefix cache hits, in tokens."
        )
        self.preemptions = c("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = c(
            "vllm:request_success", "Count of successfully processed requests.", ["finished_reason"]
        )
        self.ttft = h(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token.", TTFT_BUCKETS
        )
        self.itl = h(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", ITL_BUCKETS
        )
        self.e2e = h(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency.", E2E_BUCKETS
        )
        self.req_prompt = h(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.req_gen = h(
            "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.engine_steps = c("epdserve:engine_steps", "Engine-core steps executed.")
        self.engine_up = g("epdserve:engine_core_up", "1 while the engine-core process is alive.")
        self.kv_load_failures = c(
            "epdserve:kv_load_failures",
            "KV blocks a connector failed to load (recomputed instead).",
        )
        self.kv_save_failures = c(
            "epdserve:kv_save_failures",
            "KV blocks a connector could not store (store full, down or read-only).",
        )
        self.failed_steps = c(
            "epdserve:engine_failed_steps",
            "Engine-core steps that raised; their requests were isolated and retried.",
        )
        self.request_errors = c(
            "epdserve:request_errors",
            "Requests that ended in an error, by cause.",
            ["cause"],
        )
        self.refused = c(
            "epdserve:requests_refused",
            "Requests refused at admission with 503 + Retry-After, by reason (queue_full).",
            ["reason"],
        )
        self.refused.labels(**self.labels, reason="queue_full")  # exported from the start
        self.admitted = g(
            "epdserve:admitted_sequences",
            "Sequences of accepted requests not yet answered (the admission bound's count).",
        )
        by_source = c(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ["source"]
        )
        self.by_source = {s: by_source.labels(**self.labels, source=s) for s in PROMPT_SOURCES}
        self._add_multimodal(c)
        self.store_rejections = c(
            "epdserve:stored_values_rejected",
            "Stored KV blocks / encoder outputs refused on load (damaged, cut, mislabelled, "
            "of another model), deleted and recomputed, by kind and reason.",
            ["kind", "reason"],
        )
        self.kv_events = c(
            "epdserve:kv_event_publisher",
            "KV-event publisher counters by event: batches_published, batches_dropped, "
            "replay_requests(_invalid|_busy|_refused), replay_answers_capped, "
            "replay_batches_sent, replay_stalled, send_errors, auth_denied, publish_failures.",
            ["event"],
        )
        self.model_cpu = c(
            "epdserve:model_cpu_seconds",
            "CPU seconds the engine core spent running the model (every thread; read at "
            "most every 0.25 s, estimated from each step's wall time in between).",
        )
        self.core_input_bytes = c(
            "epdserve:core_input_bytes",
            "Bytes of requests sent from the API process to the engine core over ZeroMQ.",
        )
        self._last = SchedulerStats()
        self.lora = None  # epdserve.engine.lora.metrics.LoRAMetrics when LoRA is on

    def _add_multimodal(self, c) -> None:
        self.encoder_cache_queries = c(
            "epdserve:encoder_cache_queries", "Images looked up in the encoder cache."
        )
        self.encoder_cache_hits = c(
            "epdserve:encoder_cache_hits",
            "Images served from the encoder cache (not encoded again).",
        )
        self.encoder_runs = c("epdserve:encoder_runs", "Images the vision encoder encoded.")
        self.encoder_loads = c(
            "epdserve:encoder_loads",
            "Images whose encoder output was loaded from the shared store.",
        )

    def on_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        last = self._last
        self.prefix_queries.inc(max(0, stats.prefix_queries - last.prefix_queries))
        self.prefix_hits.inc(max(0, stats.prefix_hits - last.prefix_hits))
        self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.engine_steps.inc(max(0, stats.num_steps - last.num_steps))
        self.ext_queries.inc(max(0, stats.external_queries - last.external_queries))
        self.ext_hits.inc(max(0, stats.external_hits - last.external_hits))
        self.kv_load_failures.inc(max(0, stats.kv_load_failures - last.kv_load_failures))
        self.encoder_cache_queries.inc(max(0, stats.mm_queries - last.mm_queries))
        self.encoder_cache_hits.inc(max(0, stats.mm_hits - last.mm_hits))
        self.encoder_runs.inc(max(0, stats.encoder_runs - last.encoder_runs))
        self.encoder_loads.inc(max(0, stats.encoder_loads - last.encoder_loads))
        self.failed_steps.inc(max(0, stats.failed_steps - last.failed_steps))
        self.kv_save_failures.inc(max(0, stats.kv_save_failures - last.kv_save_failures))
        now = stats.prompt_tokens_by_source or [0] * len(PROMPT_SOURCES)
        then = last.prompt_tokens_by_source or [0] * len(PROMPT_SOURCES)
        for source, a, b in zip(PROMPT_SOURCES, now, then, strict=True):
            self.by_source[source].inc(max(0, a - b))
        self._count_rejections(stats.store_rejections, last.store_rejections)
        self.model_cpu.inc(max(0.0, stats.model_cpu_seconds - last.model_cpu_seconds))
        for event, n in stats.kv_events.items():
            grew = n - last.kv_events.get(event, 0)
            if grew > 0:
                self.kv_events.labels(**self.labels, event=event).inc(grew)
        if self.lora is not None:
            self.lora.on_stats(stats)
        self._last = stats

    def _count_rejections(self, now: dict, then: dict) -> None:
        for kind, reasons in now.items():
            for reason, n in reasons.items():
                grew = n - then.get(kind, {}).get(reason, 0)
                if grew > 0:
                    self.store_rejections.labels(**self.labels, kind=kind, reason=reason).inc(grew)

    def on_refused(self, reason: str) -> None:
        self.refused.labels(**self.labels, reason=reason).inc()

    def on_request_error(self, cause: str) -> None:
        self.request_errors.labels(**self.labels, cause=cause).inc()

    def on_request_added(self, num_prompt_tokens: int, params) -> None:
        self.prompt_tokens.inc(num_prompt_tokens * params.n)
        self.req_prompt.observe(num_prompt_tokens)

    def on_tokens(self, state, n: int, now: float) -> None:
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        ttft, itl = state.record_tokens(n, now)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def on_request_finished(self, state) -> None:
        if state.last_token_time is not None:
            self.e2e.observe(state.last_token_time - state.arrival)
        self.req_gen.observe(state.num_generated)
        for seq in state.seqs.values():
            self.success.labels(**self.labels, finished_reason=seq.finish_reason or "abort").inc()
