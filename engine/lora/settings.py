"""The LoRA settings of ``EngineConfig`` checked (errors name the field), and
``--lora-modules`` items parsed: ``name=path`` or vLLM's JSON form."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from epdserve.engine.config import EngineConfig

TRUE = ("1", "true", "yes", "on")


class LoRAModule(NamedTuple):
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoRAModule:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = item.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules: {item!r} is not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict) or set(data) - {"name", "path", "base_model_name"}:
            raise ValueError(
                f"lora_modules: {item!r} must be an object with name, path, base_model_name"
            )
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"lora_modules: {item!r} must be name=path or a JSON object")
    for key, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"lora_modules: {item!r} needs a non-empty {key}")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"lora_modules: {item!r}: base_model_name must be a string")
    return LoRAModule(name.strip(), path.strip(), base)


def check_lora_settings(config: EngineConfig) -> None:
    for name in ("max_loras", "max_lora_rank"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name}: must be at least 1, got {getattr(config, name)}")
    cpu = config.max_cpu_loras
    if cpu is not None and cpu < config.max_loras:
        raise ValueError(
            f"max_cpu_loras: must be at least max_loras ({config.max_loras}), got {cpu}"
        )
    modules = [parse_lora_module(m) for m in config.lora_modules]
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: adapter names must be unique, got {names}")
    if modules and not config.enable_lora:
        raise ValueError("lora_modules: adapters given, but enable_lora is off (--enable-lora)")
    if config.enable_lora and os.path.isfile(os.path.join(config.model, "config.json")):
        from epdserve.engine.models.config import load_model_config

        check_lora_architecture(load_model_config(config.model))  # before any process starts
    vllm_switch = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower()
    if not config.allow_runtime_lora_updating and vllm_switch in TRUE:
        object.__setattr__(config, "allow_runtime_lora_updating", True)


def check_lora_architecture(model_cfg) -> None:
    """Refuse ``enable_lora`` for an architecture LoRA adapters cannot apply to (its
    registry entry's ``lora_refusal``: the mixture-of-experts models)."""
    from epdserve.engine.models.config import architecture_of

    why = architecture_of(model_cfg).lora_refusal
    if why:
        raise ValueError(f"enable_lora: {why}")
