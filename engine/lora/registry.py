"""The adapters a pod serves, by name (the API's ``model``): each checked when added (its
files against the base model), given a pod-local int id, never reused, and the digest of its
files (``lora.digest``)."""

from __future__ import annotations

import itertools
import re

from epdserve.engine.lora.digest import adapter_digest
from epdserve.engine.lora.peft_files import inspect_adapter
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.lora.settings import parse_lora_module
from epdserve.engine.models.config import load_model_config

# a name is a model id, a metrics label and a log field: printable, no spaces, bounded; no
# commas, as vllm:lora_requests_info joins a pod's names with them (a router splits on them)
NAME = re.compile(r"[!-+\--~]{1,256}")
MAX_ADAPTERS = 1024  # a pod's registry (runtime loads included) stays bounded


class LoRARegistry:
    def __init__(self, model_dir: str, max_rank: int, base_model_name: str):
        self.model_cfg = load_model_config(model_dir)
        self.max_rank = max_rank
        self.base_model_name = base_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter's files and serve it as ``name``; ``ValueError`` names what is
        wrong (the name is taken, a file is missing or malformed, rank, target modules)."""
        if not name:
            raise ValueError("lora_name: must be a non-empty string")
        if not NAME.fullmatch(name):
            raise ValueError(
                "lora_name: must be 1-256 printable ASCII characters without spaces or commas, "
                f"got {name[:64]!r}"
            )
        if len(self.adapters) >= MAX_ADAPTERS:
            raise ValueError(f"lora_name: this pod already serves {MAX_ADAPTERS} adapters")
        if name == self.base_model_name:
            raise ValueError(f"lora_name: {name!r} is the served base model's name")
        if name in self.adapters:
            raise ValueError(f"lora_name: the LoRA adapter {name!r} has already been loaded")
        if base_model_name is not None and base_model_name != self.base_model_name:
            raise ValueError(
                f"base_model_name: {base_model_name!r} is not the served model "
                f"({self.base_model_name!r})"
            )
        inspect_adapter(path, self.model_cfg, self.max_rank)
        digest = adapter_digest(path)  # what the core checks its read against
        lora = LoRARequest(name, next(self._ids), str(path), base_model_name, digest)
        self.adapters[name] = lora
        return lora

    def add_modules(self, items: list[str]) -> None:
        """The ``--lora-modules`` adapters, at start (an error ends the start, named)."""
        for item in items:
            module = parse_lora_module(item)
            try:
                self.add(module.name, module.path, module.base_model_name)
            except ValueError as exc:
                raise ValueError(f"lora_modules: {module.name}: {exc}") from None

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)
