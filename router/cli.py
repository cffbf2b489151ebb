"""``epdserve router``: the cache-aware OpenAI gateway (no torch)."""

from __future__ import annotations

import argparse
import os
import sys

from epdserve.common.logs import FORMATS, LEVELS
from epdserve.router.strategy import STRATEGIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's flags (the operator uses exactly these)."""
    a = parser.add_argument
    a("--host", default="0.0.0.0", help="address to listen on")
    a("--port", type=int, default=8000, help="port to listen on")
    a("--model", default=None, help="model directory: tokenizer.json + chat template")
    a("--served-model-name", default=None, help="the model name clients use")
    a("--strategy", default="prefix+load", choices=sorted(STRATEGIES), help="routing strategy")
    a(
        "--endpoint",
        action="append",
        default=[],
        help="engine pod http://HOST:PORT[,events=PORT,replay=PORT] (repeat)",
    )
    a("--prefill-endpoint", action="append", default=[], help="P/D: a prefill pod (repeat)")
    a("--decode-endpoint", action="append", default=[], help="P/D: a decode pod (repeat)")
    a("--encoder-endpoint", action="append", default=[], help="E/P/D: an encoder pod (repeat)")
    a("--discovery", default="static", choices=("static", "k8s"), help="how pods are found")
    a("--namespace", default="default", help="k8s discovery: namespace of the pods")
    a("--selector", default="", help="k8s discovery: label selector of the pods")
    a("--kubeconfig", default=None, help="k8s discovery: kubeconfig (default: in-cluster)")
    a("--target-port", type=int, default=8000, help="k8s discovery: the pods' HTTP port")
    a("--kv-events-port", type=int, default=5557, help="pods publish KV events on this port")
    a("--kv-replay-port", type=int, default=5558, help="pods' replay port (0: no replay)")
    a(
        "--kv-events-curve-dir",
        default=os.environ.get("EPDSERVE_KV_EVENTS_CURVE_DIR") or None,
        help="CurveZMQ keys for the pods' KV-event sockets: a directory with client.public, "
        "client.secret and server.public (Z85); default: env EPDSERVE_KV_EVENTS_CURVE_DIR, "
        "else no Curve",
    )
    a(
        "--kv-events-max-message-bytes",
        type=int,
        default=int(os.environ.get("EPDSERVE_KV_EVENTS_MAX_MESSAGE_BYTES") or 8 << 20),
        help="largest KV-event frame accepted from a pod; a larger one drops the connection "
        "(default 8 MiB; env EPDSERVE_KV_EVENTS_MAX_MESSAGE_BYTES)",
    )
    a("--index-capacity", type=int, default=1_000_000, help="max blocks in the prefix index")
    a("--prefix-weight", type=float, default=2.0, help="prefix+load: weight of the prefix")
    a("--load-weight", type=float, default=1.0, help="prefix+load: weight of queue depth")
    a("--kv-weight", type=float, default=0.5, help="prefix+load: weight of free KV cache")
    a(
        "--store-weight",
        type=float,
        default=1.0,
        help="prefix+load: weight of prefix blocks loadable from the pool's shared store "
        "(at most --prefix-weight: a local hit beats a store hit)",
    )
    a(
        "--balance-threshold",
        type=float,
        default=4.0,
        help="prefix+load: pods this many requests busier than the least busy go last",
    )
    a(
        "--speculative-ttl",
        type=float,
        default=2.0,
        help="s a routed prompt counts as cached on its pod before its events arrive (0: off)",
    )
    a("--block-size", type=int, default=16, help="pods' block size until their events say")
    a("--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    a("--connect-timeout", type=float, default=2.0, help="upstream connect timeout (s)")
    a("--upstream-timeout", type=float, default=600.0, help="upstream read timeout (s)")
    a(
        "--max-attempts",
        type=int,
        default=3,
        help="pods tried per request before 503 (only pod failures move on: refused, "
        "reset before the headers, 503)",
    )
    a(
        "--failure-backoff",
        type=float,
        default=2.0,
        help="s a pod that refused a request stays out of rotation (grows with repeats, x8 max)",
    )
    a(
        "--max-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="larger request bodies get 413 (image data URLs are big)",
    )
    a(
        "--limit-concurrency",
        type=int,
        default=4096,
        help="open client connections plus requests in progress beyond which the router "
        "answers 503 (room for 1,000 slow clients, which the read timeouts close)",
    )
    a("--timeout-keep-alive", type=float, default=5.0, help="s an idle client connection stays")
    a(
        "--header-read-timeout",
        type=float,
        default=10.0,
        help="s a client has to send the request line and headers (408 and close)",
    )
    a(
        "--body-read-timeout",
        type=float,
        default=60.0,
        help="s a client has to send the whole request body (408 and close)",
    )
    a(
        "--max-upstream-connections",
        type=int,
        default=4096,
        help="connections to all pods together; a request that finds none free within "
        "--connect-timeout gets 503 with Retry-After",
    )
    a(
        "--max-pod-connections",
        type=int,
        default=1024,
        help="requests in flight to one pod; a pod at this count is busy (others are "
        "tried; all busy: 503 with Retry-After)",
    )
    a(
        "--api-key",
        default=os.environ.get("EPDSERVE_API_KEY") or None,
        help="require Authorization: Bearer KEY on every route but /health, /ready, "
        "/metrics (default: env EPDSERVE_API_KEY)",
    )
    a(
        "--log-level",
        default="info",
        type=str.lower,
        choices=LEVELS,
        help="log level; per-request and per-scrape lines only at debug",
    )
    a(
        "--log-format",
        default="text",
        choices=FORMATS,
        help="text lines, or json: one object per line (time, level, logger, message)",
    )
    a(
        "--access-log",
        action="store_true",
        help="log one line per HTTP request (uvicorn's access log; off by default)",
    )


def validate(args: argparse.Namespace) -> None:
    """Check flag combinations; raises ValueError naming the flag."""
    pd = args.prefill_endpoint or args.decode_endpoint or args.encoder_endpoint
    if args.discovery == "static" and not (args.endpoint or pd):
        raise ValueError(
            "--endpoint (or --prefill-endpoint and --decode-endpoint) is required "
            "with --discovery static"
        )
    if args.discovery == "static" and pd and not (args.prefill_endpoint and args.decode_endpoint):
        raise ValueError("P/D needs both --prefill-endpoint and --decode-endpoint")
    if args.discovery == "k8s" and not args.selector:
        raise ValueError("--selector is required with --discovery k8s")
    if args.index_capacity < 1:
        raise ValueError("--index-capacity must be >= 1")
    if args.block_size < 1:
        raise ValueError("--block-size must be >= 1")
    if args.scrape_interval <= 0:
        raise ValueError("--scrape-interval must be > 0")
    if args.max_body_bytes < 1:
        raise ValueError("--max-body-bytes must be >= 1")
    if args.failure_backoff < 0:
        raise ValueError("--failure-backoff must be >= 0")
    for flag in ("limit_concurrency", "max_upstream_connections", "max_pod_connections"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("timeout_keep_alive", "header_read_timeout", "body_read_timeout"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    if args.kv_events_max_message_bytes < 1024:
        raise ValueError("--kv-events-max-message-bytes must be >= 1024")


def event_options(args: argparse.Namespace):
    """The pods' event sockets as the flags say; a bad key file is a ValueError naming it."""
    from epdserve.connectors.kv_events import CurveClientKeys
    from epdserve.router.subscriber import EventSocketOptions

    curve = CurveClientKeys.load(args.kv_events_curve_dir) if args.kv_events_curve_dir else None
    return EventSocketOptions(curve, args.kv_events_max_message_bytes)


ROLE_LABEL = "epdserve.io/role"


def build(args: argparse.Namespace):
    """The FastAPI app for these flags (tests call this too)."""
    from epdserve.router.app import ProxySettings, build_app
    from epdserve.router.disagg import DisaggRouters
    from epdserve.router.discovery import KubernetesDiscovery, RoleDiscovery, StaticDiscovery
    from epdserve.router.index import PrefixIndex
    from epdserve.router.metrics import RouterMetrics
    from epdserve.router.pods import PodEndpoint
    from epdserve.router.seedcheck import RootHashCheck
    from epdserve.router.service import Router
    from epdserve.router.strategy import make_strategy
    from epdserve.router.tokenize import PromptTokenizer

    validate(args)
    events = event_options(args)
    weights = {}
    if args.strategy == "prefix+load":
        weights = dict(
            prefix_weight=args.prefix_weight,
            load_weight=args.load_weight,
            kv_weight=args.kv_weight,
            balance_threshold=args.balance_threshold,
            store_weight=args.store_weight,
        )
    strategy = make_strategy(args.strategy, **weights)
    tokenizer = PromptTokenizer(args.model) if args.model else None
    replay = args.kv_replay_port or None
    metrics = RouterMetrics()
    root_check = RootHashCheck(metrics)  # one per pool: every role's pods must agree

    def new_router(role="colocated", role_strategy=strategy) -> Router:
        return Router(
            role_strategy,
            tokenizer,
            args.served_model_name,
            PrefixIndex(args.index_capacity),
            metrics=metrics,
            speculative_ttl=args.speculative_ttl,
            default_block_size=args.block_size,
            root_check=root_check,
            engine_role=role,
            event_options=events,
        )

    router = new_router()
    disagg = None
    if args.discovery == "static":
        endpoints = [PodEndpoint.parse(u, args.kv_events_port, replay) for u in args.endpoint]
        pairs = [(router, StaticDiscovery(endpoints))]
        if args.prefill_endpoint or args.decode_endpoint:
            disagg = DisaggRouters(
                new_router("prefill"),
                new_router("decode"),
                new_router("encoder", make_strategy("least-load")),
            )
            for role_router, specs in (
                (disagg.prefill, args.prefill_endpoint),
                (disagg.decode, args.decode_endpoint),
                (disagg.encoder, args.encoder_endpoint),
            ):
                eps = [PodEndpoint.parse(u, args.kv_events_port, replay) for u in specs]
                pairs.append((role_router, StaticDiscovery(eps)))
    else:

        def k8s(selector: str) -> KubernetesDiscovery:
            return KubernetesDiscovery(
                args.namespace,
                selector,
                args.target_port,
                args.kv_events_port,
                replay,
                kubeconfig=args.kubeconfig,
            )

        if ROLE_LABEL in args.selector:  # the caller already picked one role
            pairs = [(router, k8s(args.selector))]
        else:  # a whole pool: split its pods by role
            disagg = DisaggRouters(
                new_router("prefill"),
                new_router("decode"),
                new_router("encoder", make_strategy("least-load")),
            )
            pairs = [(router, k8s(f"{args.selector},{ROLE_LABEL}=colocated"))]
            for role in ("prefill", "decode", "encoder"):
                pairs.append((getattr(disagg, role), k8s(f"{args.selector},{ROLE_LABEL}={role}")))
    discovery = RoleDiscovery(pairs)
    settings = ProxySettings(
        connect_timeout=args.connect_timeout,
        upstream_timeout=args.upstream_timeout,
        max_attempts=args.max_attempts,
        failure_backoff=args.failure_backoff,
        scrape_interval=args.scrape_interval,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or None,
        body_timeout=args.body_read_timeout,
        max_upstream_connections=args.max_upstream_connections,
        max_pod_connections=args.max_pod_connections,
    )
    return build_app(router, settings, discovery, disagg)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import uvicorn

    from epdserve.common.logs import setup_logging
    from epdserve.connectors.slow_clients import HTTPLimits

    setup_logging(args.log_level, args.log_format)
    try:
        app = build(args)
    except ValueError as exc:
        print(f"epdserve router: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # uvicorn's loggers propagate to ours (text or json)
        access_log=args.access_log,
        timeout_graceful_shutdown=5,
        **HTTPLimits(  # concurrency limit, keep-alive, header deadline (body: in the app)
            limit_concurrency=args.limit_concurrency,
            timeout_keep_alive=args.timeout_keep_alive,
            header_timeout=args.header_read_timeout,
            body_timeout=args.body_read_timeout,
        ).uvicorn_options(),
    )
    return 0
