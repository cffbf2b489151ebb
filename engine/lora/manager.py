"""The engine core's adapters: read off the step loop into a host LRU, placed on device slots.

A background thread reads an adapter's files (``peft_files``) into fp32 host tensors; up to
``max_cpu_loras`` stay there (least recently used leaves first). A request runs only when its
adapter is on one of the ``max_loras`` device slots: stacked A/B per layer and target module,
zero-padded to ``max_lora_rank``, which the decoder reads through ``LoRABatch``. Placing an
adapter is a host-to-device copy between steps; a slot evicted (least recently used first) is
never one that a running request uses: the scheduler names those (``busy``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from epdserve.engine.lora.peft_files import (
    TARGET_MODULES,
    inspect_adapter,
    load_adapter,
    module_shapes,
)
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.models.config import ModelConfig

log = logging.getLogger("epdserve.lora")

MAX_FAILURES_KEPT = 256


class LoRALoadError(ValueError):
    """An adapter's files could not be read into the engine (the request gets a 400)."""


class LoRAManager:
    """Adapters by int id: being read, on the host, on device slots; the stacks the model reads.

    ``stacks[layer][module] = (A [S, r_max, in], B [S, out, r_max])`` and ``scaling [S]`` are
    allocated once; slot ``s`` of every stack holds one adapter (zeros where it has no
    weights)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.cfg, self.max_rank, self.max_cpu_loras = cfg, max_rank, max_cpu_loras
        shapes = module_shapes(cfg)
        self.stacks = [
            {
                m: (
                    torch.zeros(max_loras, max_rank, shapes[m][0], dtype=dtype, device=device),
                    torch.zeros(max_loras, shapes[m][1], max_rank, dtype=dtype, device=device),
                )
                for m in TARGET_MODULES
            }
            for _ in range(cfg.num_layers)
        ]
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.slot_owner: list[int | None] = [None] * max_loras
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self.names: dict[int, str] = {}  # lora id -> name, of adapters on slots
        self.host: OrderedDict[int, tuple[float, dict]] = OrderedDict()  # id -> weights, LRU
        self.loading: dict[int, Future] = {}
        self.failed: OrderedDict[int, str] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.num_loads = self.num_slot_writes = 0

    @property
    def max_loras(self) -> int:
        return len(self.slot_owner)

    # --- host side ---------------------------------------------------------------------
    def prefetch(self, lora: LoRARequest) -> None:
        """Start reading ``lora`` unless it is read, being read, or placed."""
        lid = lora.lora_int_id
        if lid in self.slots or lid in self.host or lid in self.loading or lid in self.failed:
            return
        self.loading[lid] = self._pool.submit(self._read, lora)

    def _read(self, lora: LoRARequest) -> tuple[float, dict]:
        spec = inspect_adapter(lora.lora_path, self.cfg, self.max_rank)
        return spec.scaling, load_adapter(spec)

    def _host_weights(self, lora: LoRARequest) -> tuple[float, dict] | None:
        """The adapter's host weights; None while being read. ``LoRALoadError`` if unreadable."""
        lid = lora.lora_int_id
        if lid in self.failed:
            raise LoRALoadError(f"LoRA adapter {lora.lora_name!r}: {self.failed[lid]}")
        if lid in self.host:
            self.host.move_to_end(lid)
            return self.host[lid]
        self.prefetch(lora)
        future = self.loading[lid]
        if not future.done():
            return None
        del self.loading[lid]
        try:
            weights = future.result()
        except Exception as exc:
            reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            self.failed[lid] = reason
            while len(self.failed) > MAX_FAILURES_KEPT:
                self.failed.popitem(last=False)
            log.warning("LoRA adapter %s (%s) failed to load: %s", lora.lora_name, lid, reason)
            raise LoRALoadError(f"LoRA adapter {lora.lora_name!r}: {reason}") from None
        self.num_loads += 1
        self.host[lid] = weights
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return weights

    # --- device slots --------------------------------------------------------------------
    def slot_of(self, lora: LoRARequest | None) -> int:
        """The slot ``lora`` is on (-1: base model, or not placed)."""
        if lora is None:
            return -1
        return self.slots.get(lora.lora_int_id, -1)

    def touch(self, lora: LoRARequest) -> bool:
        """Whether ``lora`` is on a slot (then it becomes the most recently used)."""
        lid = lora.lora_int_id
        if lid in self.slots:
            self.slots.move_to_end(lid)
            return True
        return False

    def acquire(self, lora: LoRARequest, busy: set[int]) -> bool:
        """Put ``lora`` on a slot if it is not on one; False while it is being read or every
        slot holds an adapter of ``busy`` (ids of running requests). ``LoRALoadError`` when
        its files cannot be read."""
        if self.touch(lora):
            return True
        weights = self._host_weights(lora)
        if weights is None:
            return False
        slot = self._free_slot(busy)
        if slot is None:
            return False
        self._write(slot, *weights)
        lid = lora.lora_int_id
        self.slot_owner[slot] = lid
        self.slots[lid] = slot
        self.names[lid] = lora.lora_name
        return True

    def _free_slot(self, busy: set[int]) -> int | None:
        if None in self.slot_owner:
            return self.slot_owner.index(None)
        for lid in self.slots:  # least recently used first
            if lid not in busy:
                self.release(lid)
                return self.slot_owner.index(None)
        return None

    def release(self, lid: int) -> None:
        """Take adapter ``lid`` off its slot (its weights stay in the stacks until overwritten;
        no request may point at the slot)."""
        slot = self.slots.pop(lid, None)
        if slot is not None:
            self.slot_owner[slot] = None
            self.names.pop(lid, None)

    def forget(self, lid: int) -> None:
        """Drop adapter ``lid`` everywhere (no live request may use it): its slot, its host
        weights, a read in flight, a remembered failure."""
        self.release(lid)
        self.host.pop(lid, None)
        self.failed.pop(lid, None)
        future = self.loading.pop(lid, None)
        if future is not None:
            future.cancel()

    def _write(self, slot: int, scaling: float, weights: dict) -> None:
        for layer, stacks in enumerate(self.stacks):
            for module, (a_stack, b_stack) in stacks.items():
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                pair = weights.get((layer, module))
                if pair is not None:
                    a, b = pair
                    a_stack[slot, : a.shape[0]].copy_(a)
                    b_stack[slot, :, : b.shape[1]].copy_(b)
        self.scaling[slot] = scaling
        self.num_slot_writes += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
