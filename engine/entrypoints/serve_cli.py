"""``epdserve serve MODEL``: one engine pod (OpenAI server + engine-core process).

The flags are the fields of two typed structs: ``EngineConfig`` (engine/config.py) and
``ServeOptions`` below (the server's address, key, limits and logs). Every flag can also come
from the environment as ``EPDSERVE_<FIELD>`` (``--max-model-len`` → ``EPDSERVE_MAX_MODEL_LEN``),
which is how the operator configures pods; a flag given on the command line wins
(common/cli_fields.py).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, replace

from epdserve.common.cli_fields import add_fields, from_args, setting
from epdserve.common.logs import FORMATS
from epdserve.common.prompt_signing import PromptSigner, check_key

# tool_parsers.PARSERS' names (not imported here: the flags stay cheap to build)
TOOL_CALL_PARSERS = ("llama3_json", "hermes")


@dataclass(frozen=True)
class ServeOptions:
    """The server's settings that are not engine config; validated here, naming the field."""

    revision: str | None = setting(None, "hub revision of MODEL")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    served_model_name: str | None = setting(None, "the model name clients use (default: MODEL)")
    api_key: str | None = setting(
        None, "require Authorization: Bearer KEY on /v1/*, /tokenize and /detokenize"
    )
    processed_prompt_key: str | None = setting(
        None,
        "the pool's key (a Secret; the operator sets EPDSERVE_PROCESSED_PROMPT_KEY): processed "
        "prompts this pod returns are signed with it, and one it is sent is taken only if "
        "signed with it (else 400)",
    )
    enable_auto_tool_choice: bool = setting(
        False, 'tool_choice "auto" reads tool calls out of the output (needs --tool-call-parser)'
    )
    tool_call_parser: str | None = setting(
        None,
        'how the model writes tool calls: llama3_json ({"name": ..., "parameters": ...} '
        "JSON) or hermes (<tool_call> blocks, Qwen)",
        choices=TOOL_CALL_PARSERS,
    )
    max_logprobs: int = setting(
        20, "most logprobs/top_logprobs/prompt_logprobs a request may ask for"
    )
    max_request_body_bytes: int = setting(32 << 20, "larger request bodies are refused with 413")
    limit_mm_per_prompt: dict | None = setting(
        None, "most images per request as JSON, e.g. '{\"image\": 4}' (default 8)"
    )
    max_image_pixels: int = setting(
        25_000_000,
        "most pixels one image may decode to, read from its header before decoding "
        "(default 25 M: a 24-megapixel photo fits)",
    )
    max_pixels_per_request: int = setting(
        100_000_000,
        "most pixels a request's images may decode to together, checked before the "
        "first is decoded (default 100 M: eight 12-megapixel phone photos fit)",
    )
    allowed_media_domains: list[str] = setting(
        [], "hosts whose http(s) image URLs may be fetched (default: none)"
    )
    allowed_local_media_path: str | None = setting(
        None, "file:// image URLs are read only below this directory (default: refused)"
    )
    media_fetch_timeout: float = setting(10.0, "seconds an image fetch may take")
    max_queued_requests: int | None = setting(
        None,
        "sequences (n per prompt) that may wait beyond the --max-num-seqs running; "
        "past that a request gets 503 with Retry-After and the router tries another pod. "
        "Default 4 x --max-num-seqs: a full queue drains in about four generations of a "
        "full batch, so waiting stays bounded while a burst still queues",
    )
    limit_concurrency: int | None = setting(
        None,
        "open connections plus requests in progress beyond which the server answers 503 "
        "(default: 4096, or twice the admission bound if larger; room for 1,000 slow "
        "clients, which the read timeouts close)",
    )
    timeout_keep_alive: float = setting(5.0, "seconds an idle keep-alive connection stays open")
    header_read_timeout: float = setting(
        10.0, "seconds a client has to send the request line and headers (408 and close)"
    )
    body_read_timeout: float = setting(
        60.0, "seconds a client has to send the whole request body (408 and close)"
    )
    drain_timeout: float = setting(
        30.0, "seconds in-flight requests may take to finish after SIGTERM (scale-down)"
    )
    log_level: str = setting("info", "log level of both processes")
    log_format: str = setting(
        "text", "json: one object per line (time, level, logger, message)", choices=FORMATS
    )
    access_log: bool = setting(False, "log one line per HTTP request (off by default)")

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be non-negative, got {self.max_logprobs}")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes: must be positive")
        object.__setattr__(self, "limit_mm_per_prompt", _limit_mm(self.limit_mm_per_prompt))
        path = self.allowed_local_media_path
        if path and not os.path.isdir(path):
            raise ValueError("allowed_local_media_path: not a directory")
        for name in ("max_image_pixels", "max_pixels_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(
                f"max_queued_requests: must be non-negative, got {self.max_queued_requests}"
            )
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout: must be non-negative")
        check_key(self.processed_prompt_key, "processed_prompt_key")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice: requires --tool-call-parser")

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser tool_choice "auto" uses: set only with both tool flags (as vLLM)."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def request_limits(self):
        """``(RequestLimits, ImageLimits)``: per-request and image-loading limits."""
        from epdserve.engine.entrypoints.openai.limits import RequestLimits
        from epdserve.engine.inputs.images import ImageLimits

        limits = RequestLimits(
            max_logprobs=self.max_logprobs,
            max_body_bytes=self.max_request_body_bytes,
            max_images=self.limit_mm_per_prompt.get("image", 8),
        )
        images = ImageLimits(
            allowed_hosts=frozenset(self.allowed_media_domains),
            fetch_timeout_s=self.media_fetch_timeout,
            local_media_path=self.allowed_local_media_path or None,
            max_pixels=self.max_image_pixels,
            max_pixels_per_request=self.max_pixels_per_request,
        )
        return limits, images

    def http_limits(self, max_num_seqs: int):
        """``(admission bound, HTTPLimits)`` for an engine running ``max_num_seqs``."""
        from epdserve.connectors.slow_clients import DEFAULT_LIMIT_CONCURRENCY, HTTPLimits
        from epdserve.engine.entrypoints.openai.admission import default_max_queued

        queued = self.max_queued_requests
        if queued is None:
            queued = default_max_queued(max_num_seqs)
        concurrency = self.limit_concurrency
        if concurrency is None:
            concurrency = max(DEFAULT_LIMIT_CONCURRENCY, 2 * (max_num_seqs + queued))
        limits = HTTPLimits(
            limit_concurrency=concurrency,
            timeout_keep_alive=self.timeout_keep_alive,
            header_timeout=self.header_read_timeout,
            body_timeout=self.body_read_timeout,
        )
        return queued, limits


def _limit_mm(value) -> dict:
    """``--limit-mm-per-prompt`` (JSON text or a dict) as ``{"image": N}``."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt: not valid JSON ({exc.msg})") from None
    value = value or {}
    if not isinstance(value, dict) or set(value) - {"image"}:
        raise ValueError('limit_mm_per_prompt: expected JSON like {"image": 4}')
    images = value.get("image", 8)
    if not isinstance(images, int) or isinstance(images, bool) or images < 0:
        raise ValueError("limit_mm_per_prompt: image must be a non-negative integer")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from epdserve.engine.config import EngineConfig

    add_fields(p, EngineConfig)
    add_fields(p, ServeOptions)


def run(args: argparse.Namespace) -> int:
    from epdserve.common.logs import setup_logging
    from epdserve.engine.config import EngineConfig
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

        # every flag is parsed and checked here, once, before any download
        config = from_args(EngineConfig, args)
        opts = from_args(ServeOptions, args)
        limits, image_limits = opts.request_limits()
        queued, http = opts.http_limits(config.max_num_seqs)
        name = opts.served_model_name or config.model
        # a hub id names the model; every component below reads the local snapshot
        config = replace(config, model=resolve_model(config.model, opts.revision))
    except ValueError as exc:
        raise SystemExit(f"epdserve serve: {exc}") from exc
    state = ServerState(config, name, opts.api_key, limits, image_limits, queued, http)
    state.serving.tool_parser_name = opts.auto_tool_parser
    if opts.processed_prompt_key:
        state.serving.inputs.signer = PromptSigner(opts.processed_prompt_key)
    serve(
        build_app(state),
        state,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level.lower(),
        access_log=opts.access_log,
        drain_timeout=opts.drain_timeout,
    )
    return 0
