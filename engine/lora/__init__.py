"""LoRA adapters: PEFT directories read and checked, placed on device slots, applied per token."""

from epdserve.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
