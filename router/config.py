"""``RouterConfig``: every setting of ``epdserve router``, typed and checked at construction.

Each field is a flag and an ``EPDSERVE_*`` variable (common/cli_fields.py): ``--max-attempts``
is ``EPDSERVE_MAX_ATTEMPTS``; a flag wins. The operator passes exactly these flag names
(operator/router.py). Errors name the flag, as the router always has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from epdserve.common.cli_fields import setting
from epdserve.common.logs import FORMATS, LEVELS
from epdserve.common.prompt_signing import check_key
from epdserve.router.lora import AdapterPolicy, parse_modules
from epdserve.router.strategy import STRATEGIES

POSITIVE_INTS = ("limit_concurrency", "max_upstream_connections", "max_pod_connections")
TOKEN = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]{1,64}$")  # an HTTP header name
POSITIVE_SECONDS = ("timeout_keep_alive", "header_read_timeout", "body_read_timeout")
POSITIVE_FLOATS = ("scrape_interval", "lora_spread_load", "lora_models_interval", *POSITIVE_SECONDS)


@dataclass(frozen=True)
class RouterConfig:
    host: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(8000, "port to listen on")
    model: str | None = setting(None, "model directory: tokenizer.json + chat template")
    served_model_name: str | None = setting(None, "the model name clients use")
    strategy: str = setting("prefix+load", "routing strategy", choices=tuple(sorted(STRATEGIES)))
    endpoint: list[str] = setting(
        [], "engine pod http://HOST:PORT[,events=PORT,replay=PORT] (repeat)", repeat=True
    )
    prefill_endpoint: list[str] = setting([], "P/D: a prefill pod (repeat)", repeat=True)
    decode_endpoint: list[str] = setting([], "P/D: a decode pod (repeat)", repeat=True)
    encoder_endpoint: list[str] = setting([], "E/P/D: an encoder pod (repeat)", repeat=True)
    discovery: str = setting("static", "how pods are found", choices=("static", "k8s"))
    namespace: str = setting("default", "k8s discovery: namespace of the pods")
    selector: str = setting("", "k8s discovery: label selector of the pods")
    kubeconfig: str | None = setting(None, "k8s discovery: kubeconfig (default: in-cluster)")
    target_port: int = setting(8000, "k8s discovery: the pods' HTTP port")
    kv_events_port: int = setting(5557, "pods publish KV events on this port")
    kv_replay_port: int = setting(5558, "pods' replay port (0: no replay)")
    kv_events_curve_dir: str | None = setting(
        None,
        "CurveZMQ keys for the pods' KV-event sockets: a directory with client.public, "
        "client.secret and server.public (Z85); default: no Curve",
    )
    kv_events_max_message_bytes: int = setting(
        8 << 20,
        "largest KV-event frame accepted from a pod; a larger one drops the connection "
        "(default 8 MiB)",
    )
    index_capacity: int = setting(1_000_000, "max blocks in the prefix index")
    prefix_weight: float = setting(2.0, "prefix+load: weight of the prefix")
    load_weight: float = setting(1.0, "prefix+load: weight of queue depth")
    kv_weight: float = setting(0.5, "prefix+load: weight of free KV cache")
    store_weight: float = setting(
        1.0,
        "prefix+load: weight of prefix blocks loadable from the pool's shared store "
        "(at most --prefix-weight: a local hit beats a store hit)",
    )
    balance_threshold: float = setting(
        4.0, "prefix+load: pods this many requests busier than the least busy go last"
    )
    store_cost: float = setting(
        0.1, "prefix+cost: a token loaded from the pool's shared store, in computed tokens (0..1)"
    )
    decode_cost: float = setting(
        2.0, "prefix+cost: a request the pod is decoding, in prompt tokens of prefill"
    )
    recompute_cost: float = setting(
        0.5,
        "prefix+cost: extra cost of each prompt token a pod must compute, for the wait it "
        "adds behind it (0: the request's own wait alone)",
    )
    speculative_ttl: float = setting(
        2.0, "s a routed prompt counts as cached on its pod before its events arrive (0: off)"
    )
    block_size: int = setting(16, "pods' block size until their events say")
    scrape_interval: float = setting(1.0, "seconds between /metrics scrapes")
    connect_timeout: float = setting(2.0, "upstream connect timeout (s)")
    upstream_timeout: float = setting(600.0, "upstream read timeout (s)")
    max_attempts: int = setting(
        3,
        "pods tried per request before 503 (only pod failures move on: refused, "
        "reset before the headers, 503)",
    )
    failure_backoff: float = setting(
        2.0, "s a pod that refused a request stays out of rotation (grows with repeats, x8 max)"
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024, "larger request bodies get 413 (image data URLs are big)"
    )
    limit_concurrency: int = setting(
        4096,
        "open client connections plus requests in progress beyond which the router "
        "answers 503 (room for 1,000 slow clients, which the read timeouts close)",
    )
    timeout_keep_alive: float = setting(5.0, "s an idle client connection stays")
    header_read_timeout: float = setting(
        10.0, "s a client has to send the request line and headers (408 and close)"
    )
    body_read_timeout: float = setting(
        60.0, "s a client has to send the whole request body (408 and close)"
    )
    max_upstream_connections: int = setting(
        4096,
        "connections to all pods together; a request that finds none free within "
        "--connect-timeout gets 503 with Retry-After",
    )
    max_pod_connections: int = setting(
        1024,
        "requests in flight to one pod; a pod at this count is busy (others are "
        "tried; all busy: 503 with Retry-After)",
    )
    lora_modules: list[str] = setting(
        [],
        "LoRA adapters the router may load on pods (with --dynamic-lora): NAME=PATH, the "
        "path as the pods see it (repeat; env: space-separated)",
        repeat=True,
    )
    dynamic_lora: bool = setting(
        False,
        "load an adapter of --lora-modules that no pod holds on a pod with a free slot, and "
        "on more pods when its holders are busy (POST /v1/load_lora_adapter; the pods need "
        "--allow-runtime-lora-updating)",
    )
    lora_spread_load: float = setting(
        4.0,
        "--dynamic-lora: when every pod holding an adapter has this many requests (in flight "
        "or queued), it is loaded on a pod with a free slot too",
    )
    lora_models_interval: float = setting(
        5.0, "s between reads of a LoRA pod's /v1/models (its adapters)"
    )
    api_key: str | None = setting(
        None, "require Authorization: Bearer KEY on every route but /health, /ready, /metrics"
    )
    processed_prompt_key: str | None = setting(
        None, "the pool's key (a Secret, as its pods'): signs the prompts it tokenizes for them"
    )
    tenant_keys: str | None = setting(
        None,
        "tenants: a JSON or YAML file {tenants: [{name, weight, priority, keys}]} (a mounted "
        "Secret); a key there names its tenant, --api-key stays valid for the default tenant",
    )
    tenant_header: str | None = setting(
        None, "trust this header (set by a gateway) for the tenant name; default: not trusted"
    )
    max_inflight_per_pod: int = setting(
        0,
        "generation requests the router sends each pod at once; past it they wait in "
        "per-tenant queues served by weight (0: no queue)",
    )
    tenant_reserve_per_pod: int = setting(
        0,
        "more requests per pod past --max-inflight-per-pod, only for tenants holding less "
        "than their weighted share (they start at once; leave that room in the pods' batch)",
    )
    tenant_queue_size: int = setting(256, "requests one tenant may have waiting (then 429)")
    tenant_queue_timeout: float = setting(30.0, "s a request may wait for a slot (then 503)")
    tenant_priority: bool = setting(
        False, "set every request's priority field: its tenant's configured priority, else 0"
    )
    tenant_admission_header: bool = setting(
        False, "answer x-epdserve-admission: the request's admission ordinal (for tests, debugging)"
    )
    log_level: str = setting(
        "info",
        "log level; per-request and per-scrape lines only at debug",
        choices=LEVELS,
        lower=True,
    )
    log_format: str = setting(
        "text",
        "text lines, or json: one object per line (time, level, logger, message)",
        choices=FORMATS,
    )
    access_log: bool = setting(
        False, "log one line per HTTP request (uvicorn's access log; off by default)"
    )

    def __post_init__(self) -> None:
        """Check flag combinations; raises ValueError naming the flag."""
        pd = self.prefill_endpoint or self.decode_endpoint or self.encoder_endpoint
        if self.discovery == "static" and not (self.endpoint or pd):
            raise ValueError(
                "--endpoint (or --prefill-endpoint and --decode-endpoint) is required "
                "with --discovery static"
            )
        both = self.prefill_endpoint and self.decode_endpoint
        if self.discovery == "static" and pd and not both:
            raise ValueError("P/D needs both --prefill-endpoint and --decode-endpoint")
        if self.discovery == "k8s" and not self.selector:
            raise ValueError("--selector is required with --discovery k8s")
        for flag in ("index_capacity", "block_size", "max_body_bytes", *POSITIVE_INTS):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        for flag in POSITIVE_FLOATS:
            if getattr(self, flag) <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
        if self.failure_backoff < 0:
            raise ValueError("--failure-backoff must be >= 0")
        if self.kv_events_max_message_bytes < 1024:
            raise ValueError("--kv-events-max-message-bytes must be >= 1024")
        parse_modules(self.lora_modules)
        for flag in ("max_inflight_per_pod", "tenant_reserve_per_pod"):
            if getattr(self, flag) < 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 0")
        if self.tenant_queue_size < 1 or self.tenant_queue_timeout <= 0:
            raise ValueError("--tenant-queue-size must be >= 1, --tenant-queue-timeout > 0")
        check_key(self.processed_prompt_key, "--processed-prompt-key")
        self.tenancy()  # a bad tenant file or header name fails here

    def adapter_policy(self) -> AdapterPolicy:
        """The LoRA settings every role's router shares."""
        return AdapterPolicy(
            sources=parse_modules(self.lora_modules),
            dynamic=self.dynamic_lora,
            spread_load=self.lora_spread_load,
            list_interval=self.lora_models_interval,
            api_key=self.api_key or None,
        )

    def tenancy(self):
        """Tenant identity and fair-queue settings; None when no tenant flag is set."""
        from epdserve.router.tenant_gate import GateSettings, Tenancy
        from epdserve.router.tenants import Identity, TenantFile, TenantTable

        if not (self.tenant_keys or self.tenant_header or self.max_inflight_per_pod):
            return None
        header = (self.tenant_header or "").strip().lower()
        if self.tenant_header is not None and not TOKEN.match(header) or header == "authorization":
            raise ValueError(f"--tenant-header must be a header name, got {self.tenant_header!r}")
        table = TenantFile(self.tenant_keys) if self.tenant_keys else TenantTable.empty()
        identity = Identity(
            table, header.encode() or None, self.api_key.encode() if self.api_key else None
        )
        gate = GateSettings(
            self.max_inflight_per_pod,
            self.tenant_reserve_per_pod,
            self.tenant_queue_size,
            self.tenant_queue_timeout,
            self.tenant_priority,
            self.tenant_admission_header,
        )
        return Tenancy(identity, gate)

    def strategy_weights(self) -> dict[str, float]:
        """The keyword arguments of ``make_strategy(self.strategy)``."""
        if self.strategy == "prefix+cost":
            costs = (self.store_cost, self.decode_cost, self.recompute_cost)
            return dict(zip(("store_cost", "decode_cost", "recompute_cost"), costs, strict=True))
        if self.strategy != "prefix+load":
            return {}
        return {
            "prefix_weight": self.prefix_weight,
            "load_weight": self.load_weight,
            "kv_weight": self.kv_weight,
            "balance_threshold": self.balance_threshold,
            "store_weight": self.store_weight,
        }

    def event_options(self):
        """The pods' event sockets as configured; a bad key file is a ValueError naming it."""
        from epdserve.connectors.kv_events import CurveClientKeys
        from epdserve.router.subscriber import EventSocketOptions

        curve = CurveClientKeys.load(self.kv_events_curve_dir) if self.kv_events_curve_dir else None
        return EventSocketOptions(curve, self.kv_events_max_message_bytes)

    def proxy_settings(self):
        from epdserve.router.app import ProxySettings

        return ProxySettings(
            connect_timeout=self.connect_timeout,
            upstream_timeout=self.upstream_timeout,
            max_attempts=self.max_attempts,
            failure_backoff=self.failure_backoff,
            scrape_interval=self.scrape_interval,
            max_body_bytes=self.max_body_bytes,
            api_key=self.api_key or None,
            body_timeout=self.body_read_timeout,
            max_upstream_connections=self.max_upstream_connections,
            max_pod_connections=self.max_pod_connections,
            tenancy=self.tenancy(),
        )

    def http_limits(self):
        """Concurrency limit, keep-alive and read deadlines of the client side."""
        from epdserve.connectors.slow_clients import HTTPLimits

        return HTTPLimits(
            limit_concurrency=self.limit_concurrency,
            timeout_keep_alive=self.timeout_keep_alive,
            header_timeout=self.header_read_timeout,
            body_timeout=self.body_read_timeout,
        )
