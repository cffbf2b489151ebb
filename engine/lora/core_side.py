"""The engine core's LoRA glue: its manager from the config, a request's adapter checked at
add, and requests whose adapter failed to load answered (400)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epdserve.engine.core.interfaces import EngineCoreOutput
from epdserve.engine.core.request import RequestStatus
from epdserve.engine.lora.manager import LoRAManager
from epdserve.engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core.request_queues import RequestQueues


def make_manager(config: EngineConfig, model) -> LoRAManager | None:
    """The core's adapters (None unless ``enable_lora``)."""
    if not config.enable_lora:
        return None
    return LoRAManager(
        model.config,
        config.max_loras,
        config.max_lora_rank,
        config.max_cpu_loras or config.max_loras,
        model.dtype,
        model.device,
    )


def check_request(manager: LoRAManager | None, lora: LoRARequest | None) -> None:
    """Refuse an adapter on an engine without LoRA; start reading it otherwise."""
    if lora is None:
        return
    if manager is None:
        raise ValueError(
            f"model: LoRA adapter {lora.lora_name!r} asked for, but this engine serves no "
            "adapters (--enable-lora is off)"
        )
    manager.prefetch(lora)


def take_failures(queues: RequestQueues) -> list[EngineCoreOutput]:
    """Finish the requests whose adapter failed to load, each with a 400 naming why."""
    failures, queues.lora_failures = queues.lora_failures, []
    outputs = []
    for req_id, exc in failures:
        if not queues.finish_requests([req_id], RequestStatus.FINISHED_ABORTED):
            continue  # already gone (aborted meanwhile)
        out = EngineCoreOutput(req_id, [], finish_reason="abort", stop_reason=str(exc))
        out.error, out.error_status = str(exc), 400
        outputs.append(out)
    return outputs
