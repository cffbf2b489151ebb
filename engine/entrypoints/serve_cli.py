"""``epdserve serve MODEL``: one engine pod (OpenAI server + engine-core process).

Every flag can also come from the environment as ``EPDSERVE_<FLAG>`` (``--max-model-len``
→ ``EPDSERVE_MAX_MODEL_LEN``), which is how the operator configures pods; a flag given on
the command line wins.
"""

from __future__ import annotations

import argparse
import json
import os

ROLES = ("both", "encoder", "prefill", "decode")
BOOL_TRUE = ("1", "true", "yes", "on")


def _env(name: str, default=None):
    return os.environ.get("EPDSERVE_" + name.upper().replace("-", "_"), default)


def _env_bool(name: str, default: bool) -> bool:
    value = _env(name)
    return default if value is None else value.strip().lower() in BOOL_TRUE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=_env("model"),
        help="model directory (HF format) or HuggingFace hub id; or EPDSERVE_MODEL",
    )
    p.add_argument("--revision", default=_env("revision"), help="hub revision of MODEL")
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("port", 8000)))
    p.add_argument("--served-model-name", default=_env("served_model_name"))
    p.add_argument("--api-key", default=_env("api_key"))
    p.add_argument("--role", choices=ROLES, default=_env("role", "both"))
    p.add_argument(
        "--dtype",
        default=_env("dtype", "float32"),
        choices=("float32", "bfloat16", "float16", "auto"),
    )
    p.add_argument(
        "--device",
        default=_env("device", "auto"),
        help="auto (cuda when torch sees one, else cpu), cpu or cuda[:N]",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=float(_env("gpu_memory_utilization", 0.9)),
        help="share of the GPU's memory this engine may use; the KV cache gets what the "
        "weights and a profiled forward leave (--kv-cache-memory wins when given)",
    )
    p.add_argument(
        "--attention-backend",
        choices=("triton", "native", "torch"),
        default=_env("attention_backend") or None,
        help="attention kernels; default: triton on cuda, native (C decode) or torch on cpu",
    )
    p.add_argument("--max-model-len", type=int, default=_int_env("max_model_len"))
    p.add_argument(
        "--kv-cache-memory", type=int, default=_int_env("kv_cache_memory"), help="bytes of KV cache"
    )
    p.add_argument("--block-size", type=int, default=int(_env("block_size", 16)))
    p.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs", 256)))
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=int(_env("max_num_batched_tokens", 2048))
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("enable_prefix_caching", True),
    )
    p.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        default=_env_bool("disable_hybrid_kv_cache_manager", False),
        help="keep every layer's KV for the whole sequence (sliding-window layers included)",
    )
    p.add_argument(
        "--prefix-caching-hash-algo", default=_env("prefix_caching_hash_algo", "sha256_cbor")
    )
    p.add_argument("--hash-seed", default=_env("hash_seed"))
    p.add_argument("--seed", type=int, default=int(_env("seed", 0)))
    p.add_argument("--kv-events-config", default=_env("kv_events_config"))
    p.add_argument(
        "--kv-events-curve-dir",
        default=_env("kv_events_curve_dir"),
        help="CurveZMQ keys for the KV-event sockets: a directory with server.public, "
        "server.secret and client.public (Z85; the routers' keys, one per line)",
    )
    p.add_argument("--kv-transfer-config", default=_env("kv_transfer_config"))
    p.add_argument("--ec-transfer-config", default=_env("ec_transfer_config"))
    p.add_argument(
        "--mm-processor-kwargs",
        default=_env("mm_processor_kwargs"),
        help="image-processor options as JSON, e.g. '{\"do_pan_and_scan\": true}'",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=int(_env("max_logprobs", 20)),
        help="most logprobs/top_logprobs/prompt_logprobs a request may ask for",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=int(_env("max_request_body_bytes", 32 << 20)),
        help="larger request bodies are refused with 413",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        default=_env("limit_mm_per_prompt"),
        help="most images per request as JSON, e.g. '{\"image\": 4}' (default 8)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=int(_env("max_image_pixels", 25_000_000)),
        help="most pixels one image may decode to, read from its header before decoding "
        "(default 25 M: a 24-megapixel photo fits)",
    )
    p.add_argument(
        "--max-pixels-per-request",
        type=int,
        default=int(_env("max_pixels_per_request", 100_000_000)),
        help="most pixels a request's images may decode to together, checked before the "
        "first is decoded (default 100 M: eight 12-megapixel phone photos fit)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=(_env("allowed_media_domains") or "").split(),
        help="hosts whose http(s) image URLs may be fetched (default: none)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=_env("allowed_local_media_path"),
        help="file:// image URLs are read only below this directory (default: refused)",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=float(_env("media_fetch_timeout", 10.0)),
        help="seconds an image fetch may take",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=_int_env("max_queued_requests"),
        help="sequences (n per prompt) that may wait beyond the --max-num-seqs running; "
        "past that a request gets 503 with Retry-After and the router tries another pod. "
        "Default 4 x --max-num-seqs: a full queue drains in about four generations of a "
        "full batch, so waiting stays bounded while a burst still queues",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=_int_env("limit_concurrency"),
        help="open connections plus requests in progress beyond which uvicorn answers 503 "
        "(default: 4096, or twice the admission bound if larger; room for 1,000 slow "
        "clients, which the read timeouts close)",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=float(_env("timeout_keep_alive", 5)),
        help="seconds an idle keep-alive connection stays open",
    )
    p.add_argument(
        "--header-read-timeout",
        type=float,
        default=float(_env("header_read_timeout", 10)),
        help="seconds a client has to send the request line and headers (408 and close)",
    )
    p.add_argument(
        "--body-read-timeout",
        type=float,
        default=float(_env("body_read_timeout", 60)),
        help="seconds a client has to send the whole request body (408 and close)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(_env("drain_timeout", 30)),
        help="seconds in-flight requests may take to finish after SIGTERM (scale-down)",
    )
    p.add_argument("--log-level", default=_env("log_level", "info"))
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=_env("log_format", "text"),
        help="json: one object per line (time, level, logger, message)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        default=_env_bool("access_log", False),
        help="log one line per HTTP request (off by default)",
    )


def _int_env(name: str):
    value = _env(name)
    return int(value) if value not in (None, "") else None


def engine_config(args: argparse.Namespace):
    from epdserve.engine.config import EngineConfig

    dtype = "float32" if args.dtype == "auto" else args.dtype
    return EngineConfig(
        model=args.model,
        dtype=dtype,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        hash_seed=args.hash_seed,
        seed=args.seed,
        kv_events_config=args.kv_events_config or None,
        kv_events_curve_dir=args.kv_events_curve_dir or None,
        kv_transfer_config=args.kv_transfer_config or None,
        role=args.role,
        ec_transfer_config=args.ec_transfer_config or None,
        mm_processor_kwargs=_json_flag(args.mm_processor_kwargs, "mm_processor_kwargs"),
        attention_backend=args.attention_backend,
    )


def request_limits(args: argparse.Namespace):
    """Per-request limits and image-loading limits from the flags."""
    from epdserve.engine.entrypoints.openai.limits import RequestLimits
    from epdserve.engine.inputs.images import ImageLimits

    if args.max_logprobs < 0:
        raise ValueError(f"max_logprobs: must be non-negative, got {args.max_logprobs}")
    if args.max_request_body_bytes < 1:
        raise ValueError("max_request_body_bytes: must be positive")
    limit_mm = _json_flag(args.limit_mm_per_prompt, "limit_mm_per_prompt") or {}
    if not isinstance(limit_mm, dict) or set(limit_mm) - {"image"}:
        raise ValueError('limit_mm_per_prompt: expected JSON like {"image": 4}')
    max_images = limit_mm.get("image", 8)
    if not isinstance(max_images, int) or max_images < 0:
        raise ValueError("limit_mm_per_prompt: image must be a non-negative integer")
    if args.allowed_local_media_path and not os.path.isdir(args.allowed_local_media_path):
        raise ValueError("allowed_local_media_path: not a directory")
    for name in ("max_image_pixels", "max_pixels_per_request"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be positive, got {getattr(args, name)}")
    limits = RequestLimits(
        max_logprobs=args.max_logprobs,
        max_body_bytes=args.max_request_body_bytes,
        max_images=max_images,
    )
    images = ImageLimits(
        allowed_hosts=frozenset(args.allowed_media_domains or ()),
        fetch_timeout_s=args.media_fetch_timeout,
        local_media_path=args.allowed_local_media_path or None,
        max_pixels=args.max_image_pixels,
        max_pixels_per_request=args.max_pixels_per_request,
    )
    return limits, images


def http_limits(args: argparse.Namespace, config):
    """Admission bound and the HTTP server's limits from the flags: ``(queued, HTTPLimits)``."""
    from epdserve.connectors.slow_clients import (
        DEFAULT_LIMIT_CONCURRENCY,
        HTTPLimits,
    )
    from epdserve.engine.entrypoints.openai.admission import default_max_queued

    queued = args.max_queued_requests
    if queued is None:
        queued = default_max_queued(config.max_num_seqs)
    if queued < 0:
        raise ValueError(f"max_queued_requests: must be non-negative, got {queued}")
    concurrency = args.limit_concurrency
    if concurrency is None:
        concurrency = max(DEFAULT_LIMIT_CONCURRENCY, 2 * (config.max_num_seqs + queued))
    limits = HTTPLimits(
        limit_concurrency=concurrency,
        timeout_keep_alive=args.timeout_keep_alive,
        header_timeout=args.header_read_timeout,
        body_timeout=args.body_read_timeout,
    )
    return queued, limits


def _json_flag(text: str | None, name: str):
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc.msg})") from None


def run(args: argparse.Namespace) -> int:
    from epdserve.common.logs import setup_logging
    from epdserve.engine.entrypoints.openai.api_server import ServerState, build_app
    from epdserve.engine.entrypoints.openai.drain import serve

    # the engine-core process inherits these and logs the same way
    os.environ["EPDSERVE_LOG_LEVEL"], os.environ["EPDSERVE_LOG_FORMAT"] = (
        args.log_level,
        args.log_format,
    )
    setup_logging(args.log_level, args.log_format)
    if not args.model:
        raise SystemExit("epdserve serve: a MODEL directory is required (or EPDSERVE_MODEL)")
    try:
        from epdserve.engine.model_source import resolve_model

        http_limits(args, engine_config(args))  # flags first: named before any download
        limits, image_limits = request_limits(args)
        if args.drain_timeout < 0:
            raise ValueError("drain_timeout: must be non-negative")
        # a hub id names the model; every component below reads the local snapshot
        args.served_model_name = args.served_model_name or args.model
        args.model = resolve_model(args.model, args.revision)
        config = engine_config(args)
        queued, http = http_limits(args, config)
    except ValueError as exc:
        raise SystemExit(f"epdserve serve: {exc}") from exc
    name = args.served_model_name or args.model
    state = ServerState(config, name, args.api_key, limits, image_limits, queued, http)
    serve(
        build_app(state),
        state,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=args.access_log,
        drain_timeout=args.drain_timeout,
    )
    return 0
