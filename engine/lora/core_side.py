"""The engine core's LoRA glue: its manager (the scheduler half) from the config, a request's
adapter checked at add, slot placements handed to the executor, the API's add/remove applied."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from epdserve.engine.lora.manager import LoRAManager
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.lora.settings import check_lora_architecture

if TYPE_CHECKING:
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core.request_queues import RequestQueues
    from epdserve.engine.executor.base import Executor
    from epdserve.engine.models.config import ModelConfig


def make_manager(config: EngineConfig, model_cfg: ModelConfig) -> LoRAManager | None:
    """The core's adapters (None unless ``enable_lora``)."""
    if not config.enable_lora:
        return None
    check_lora_architecture(model_cfg)  # a model dir resolved after the config was checked
    return LoRAManager(
        model_cfg, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras
    )


def send_slot_ops(manager: LoRAManager, executor: Executor) -> None:
    """Hand the workers the slot placements and clears queued since the last step, in order.
    Each leaves the queue once the executor took it, so one that raised is sent again."""
    ops = manager.slot_ops
    while ops:
        op = ops[0]
        if isinstance(op, int):
            executor.remove_lora(op)
        else:
            executor.add_lora(op)
        ops.pop(0)


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


class LoRAMessage(msgspec.Struct, array_like=True):
    """The API process's word on an adapter: ``add`` (read it now, so its first request does
    not wait for the disk) or ``remove`` (it is unloaded: drop its weights and its slot)."""

    op: str
    lora: LoRARequest


def apply_message(manager: LoRAManager | None, queues: RequestQueues, msg: LoRAMessage) -> None:
    """``add``: start reading; ``remove``: forget the adapter, unless a live request still
    uses it (it is then evicted as any other, least recently used first)."""
    if manager is None:
        return
    if msg.op == "add":
        manager.prefetch(msg.lora)
    elif msg.op == "remove":
        lid = msg.lora.lora_int_id
        if not any(
            r.lora is not None and r.lora.lora_int_id == lid for r in queues.requests.values()
        ):
            manager.forget(msg.lora)
    else:
        raise ValueError(f"op: must be add or remove, got {msg.op!r}")
