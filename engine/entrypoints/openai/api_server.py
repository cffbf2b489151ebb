"""The OpenAI-compatible HTTP server of one engine pod (FastAPI + uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epdserve import __version__
from epdserve.connectors.slow_clients import BodyReadTimeout, HTTPLimits
from epdserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from epdserve.engine.config import EngineConfig
from epdserve.engine.entrypoints.openai import responses
from epdserve.engine.entrypoints.openai.admission import Admission, default_max_queued
from epdserve.engine.entrypoints.openai.delivery import (
    AdmittedStream,
    Once,
    guard_stream,
    until_disconnect,
)
from epdserve.engine.entrypoints.openai.errors import (
    APIError,
    error_response,
    failed_headers,
    from_value_error,
    validation_message,
)
from epdserve.engine.entrypoints.openai.limits import RequestLimits
from epdserve.engine.entrypoints.openai.lora_routes import (
    install_lora_routes,
    lora_model_cards,
    preload_loras,
    setup_lora,
)
from epdserve.engine.entrypoints.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware
from epdserve.engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from epdserve.engine.entrypoints.openai.serving import OpenAIServing
from epdserve.engine.entrypoints.openai.tool_calls import check_tool_choice
from epdserve.engine.inputs.images import ImageLimits
from epdserve.engine.inputs.processor import InputProcessor
from epdserve.engine.metrics import EngineMetrics

log = logging.getLogger("epdserve.server")


class ServerState:
    def __init__(
        self,
        config: EngineConfig,
        served_model_name: str,
        api_key: str | None,
        limits: RequestLimits | None = None,
        image_limits: ImageLimits | None = None,
        max_queued_requests: int | None = None,
        http: HTTPLimits | None = None,
    ):
        self.config = config
        self.model_name = served_model_name
        self.api_key = api_key
        self.metrics = EngineMetrics(served_model_name)
        queued = max_queued_requests
        if queued is None:
            queued = default_max_queued(config.max_num_seqs)
        self.admission = Admission(config.max_num_seqs, queued, self.metrics)
        self.http = http or HTTPLimits()
        self.engine = AsyncLLM(config, self.metrics)
        limits = limits or RequestLimits()
        inputs = InputProcessor(
            config.model,
            served_model_name,
            self.engine.tokenizer,
            image_limits,
            limits.max_images,
            config.mm_processor_kwargs,
        )
        self.serving = OpenAIServing(self.engine, served_model_name, inputs, limits, config.role)
        setup_lora(self)  # adapters, their metrics (--enable-lora)
        self.ready = False
        self.draining = False  # set on SIGTERM (drain.py): out of rotation, streams finish
        self.created = int(time.time())

    async def start(self) -> None:
        try:
            await self.engine.start()
        except Exception:
            log.exception("engine failed to start")
            await self.engine.shutdown()
            raise
        await preload_loras(self)  # --lora-modules: read by the core ahead of their requests
        self.ready = True
        self.metrics.engine_up.set(1)
        log.info("ready: serving %s", self.model_name)

    def require_engine(self) -> None:
        if self.draining:  # a 503 up front: the router retries it on another pod
            raise APIError(503, "draining: this pod is shutting down")
        if self.engine.dead:
            raise APIError(503, f"engine unavailable: {self.engine.dead}")


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # As vLLM: the port opens only once the engine can serve (uvicorn binds after the
        # lifespan starts), so /health never says 200 before a request could succeed; an
        # engine that cannot start ends the process (the pod restarts).
        await state.start()
        yield
        await state.engine.shutdown()

    app = FastAPI(title="epdserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    _install_error_handlers(app, state)
    _install_middleware(app, state)
    _install_routes(app, state)
    install_lora_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(
                400,
                f"request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}",
                "body",
            )
        first = errors[0] if errors else {}
        if first.get("type") == "value_error" and len(first.get("loc", ())) <= 1:
            err = from_value_error(ValueError(str(first.get("ctx", {}).get("error", ""))))
            return error_response(400, err.message, err.param)  # a whole-body check
        message, param = validation_message(errors)
        return error_response(400, message, param)

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError):
        return error_response(503, f"engine unavailable: {exc}")

    @app.exception_handler(RequestFailedError)
    async def failed(_: Request, exc: RequestFailedError):
        return error_response(exc.status, str(exc), headers=failed_headers(exc.status))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error ({type(exc).__name__})")


def _install_middleware(app: FastAPI, state: ServerState) -> None:
    # the last one added runs first: the key (headers only), then the body's deadline,
    # then its size while it is read
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.serving.limits.max_body_bytes)
    app.add_middleware(BodyReadTimeout, timeout=state.http.body_timeout)
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)


def _install_routes(app: FastAPI, state: ServerState) -> None:
    serving = state.serving

    @app.get("/health")
    async def health():
        if state.engine.dead:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        ok = state.ready and state.engine.healthy and not state.draining
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        state.metrics.engine_up.set(1 if state.engine.healthy else 0)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "epdserve",
                    "root": state.config.model,
                    "parent": None,
                    "max_model_len": state.engine.max_model_len or None,
                },
                *lora_model_cards(state),
            ],
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        state.require_engine()
        prep = await serving.prepare_completion(req)
        return await _respond(raw, prep, req)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        state.require_engine()
        prep = await serving.prepare_chat(req)
        check_tool_choice(serving, prep)  # "auto" needs --enable-auto-tool-choice
        return await _respond(raw, prep, req)

    async def _respond(raw: Request, prep, req):
        label = raw.headers.get("x-request-id")
        if label is not None:  # a label only (logs, the echo); the engine's id is our own
            _check_request_id(label)
            prep.label = label
        prep.client = raw.client.host if raw.client else None  # grammar compiles' turns
        headers = {"X-Request-Id": label or prep.request_id}
        echo = bool(getattr(req, "echo", False))
        state.admission.admit(prep.num_seqs)  # or 503 + Retry-After: the router tries another
        release = Once(state.admission.release, prep.num_seqs)
        if not req.stream:
            try:
                work = responses.full_response(serving, prep, echo)
                return JSONResponse(await until_disconnect(raw, work), headers=headers)
            finally:
                release()
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats
        body = responses.stream_response(serving, prep, echo, include_usage, continuous)
        return AdmittedStream(
            guard_stream(body), release, media_type="text/event-stream", headers=headers
        )

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        return await asyncio.to_thread(_tokenize, req)

    def _tokenize(req: TokenizeRequest) -> dict:
        try:
            if req.messages is not None:
                messages = [  # text only: /tokenize takes no images
                    {
                        "role": m.role,
                        "content": m.content
                        if isinstance(m.content, str)
                        else "".join(p.text or "" for p in m.content or []),
                    }
                    for m in req.messages
                ]
                options = {"add_generation_prompt": req.add_generation_prompt}
                ids = serving.inputs.render_chat(messages, [], options).token_ids
            elif req.prompt is not None:
                ids = serving.inputs.completion(req.prompt, req.add_special_tokens).token_ids
            else:
                raise APIError(400, "prompt: either prompt or messages is required", "prompt")
        except ValueError as exc:
            raise from_value_error(exc) from exc
        return {
            "count": len(ids),
            "max_model_len": state.engine.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        if any(t < 0 or t >= serving.tok.vocab_size for t in req.tokens):
            raise APIError(400, "tokens: ids must be within the vocabulary", "tokens")
        text = await asyncio.to_thread(serving.tok.decode, req.tokens, False)
        return {"prompt": text}


def _check_request_id(value: str) -> None:
    if not 0 < len(value) <= 128 or not value.isprintable() or " " in value:
        raise APIError(
            400, "X-Request-Id: must be 1-128 printable characters without spaces", "X-Request-Id"
        )
