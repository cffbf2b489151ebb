"""A pod's LoRA adapters over HTTP: the ``--lora-modules`` served from the start, their
``/v1/models`` cards, and vLLM's runtime ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (routes absent, so 404, unless runtime updating is allowed)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from epdserve.engine.entrypoints.openai.errors import APIError
from epdserve.engine.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from epdserve.engine.lora.metrics import LoRAMetrics
from epdserve.engine.lora.registry import LoRARegistry

log = logging.getLogger("epdserve.server")


def setup_lora(state) -> None:
    """The server's adapters and their metrics, when LoRA is on (a bad ``--lora-modules``
    adapter fails the start, named)."""
    config = state.config
    if not config.enable_lora:
        return
    registry = LoRARegistry(config.model, config.max_lora_rank, state.model_name)
    registry.add_modules(config.lora_modules)
    state.serving.loras = registry
    metrics = state.metrics
    metrics.lora = LoRAMetrics(
        metrics.registry, config.max_loras, metrics.labels, registry.adapters
    )
    state.lora_lock = asyncio.Lock()


async def preload_loras(state) -> None:
    """Have the core read the ``--lora-modules`` adapters now (their first requests then wait
    for no disk)."""
    if state.serving.loras is not None:
        for lora in state.serving.loras.adapters.values():
            await state.engine.send_lora("add", lora)


def lora_model_cards(state) -> list[dict]:
    """One ``/v1/models`` entry per adapter, after the base model's."""
    registry = state.serving.loras
    if registry is None:
        return []
    return [
        {
            "id": lora.lora_name,
            "object": "model",
            "created": state.created,
            "owned_by": "epdserve",
            "root": lora.lora_path,
            "parent": lora.base_model_name or state.model_name,
            "max_model_len": None,
            "permission": [{"object": "model_permission", "allow_sampling": True}],
        }
        for lora in registry.adapters.values()
    ]


def install_lora_routes(app: FastAPI, state) -> None:
    if not state.config.allow_runtime_lora_updating:
        return
    log.warning("runtime LoRA loading and unloading is enabled (/v1/load_lora_adapter)")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        registry = _registry(state)
        async with state.lora_lock:
            if req.load_inplace and registry.get(req.lora_name) is not None:
                await state.engine.send_lora("remove", registry.remove(req.lora_name))
            try:  # the adapter's config and header are read off the event loop
                lora = await asyncio.to_thread(registry.add, req.lora_name, req.lora_path)
            except ValueError as exc:
                if registry.get(req.lora_name) is None:  # an in-place load that failed
                    state.metrics.lora.on_unloaded(req.lora_name)
                param = "lora_name" if str(exc).startswith("lora_name") else "lora_path"
                raise APIError(400, str(exc), param) from None
            await state.engine.send_lora("add", lora)  # the core reads it now
        log.info("loaded LoRA adapter %s from %s", req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        registry = _registry(state)
        async with state.lora_lock:
            lora = registry.remove(req.lora_name)
            if lora is None:
                raise APIError(
                    404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name"
                )
            state.metrics.lora.on_unloaded(req.lora_name)
            await state.engine.send_lora("remove", lora)
        log.info("unloaded LoRA adapter %s", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _registry(state) -> LoRARegistry:
    if state.serving.loras is None:
        raise APIError(400, "LoRA is off on this pod (start it with --enable-lora)", "lora_name")
    return state.serving.loras
