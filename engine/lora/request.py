"""``LoRARequest``: which adapter a request runs with (vLLM's name, int id and path)."""

from __future__ import annotations

import re

import msgspec

_HEX = re.compile(r"[0-9a-f]{32}")


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """An adapter as the engine knows it: its name (the API's ``model``), a pod-local int id
    (> 0, what KV events carry), its PEFT directory and the digest of its files when it was
    loaded (``lora.digest``). Name and digest together are the block-hash extra key: a name
    reloaded from other files names other blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name: must be a non-empty string")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be at least 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path: must be a non-empty string")
        if self.digest is not None and not _HEX.fullmatch(self.digest):
            raise ValueError("digest: must be 32 lowercase hex digits")
