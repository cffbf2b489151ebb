"""The scheduler half of LoRA: adapters read off the step loop into a host LRU, and which one
sits on which device slot.

A background thread reads an adapter's files (``peft_files``) into fp32 host bytes, checked
against the digest they had when the adapter was loaded; up to ``max_cpu_loras`` stay there
(least recently used leaves first), keyed by that digest, so names over the same files share
one read. Reads in flight are bounded by the same number: the core holds at most twice
``max_cpu_loras`` adapters' host weights, however many names are loaded. A request runs only when its
adapter is on one of the ``max_loras`` device slots. Placing an adapter queues a
``LoRASlotLoad`` that the core hands to the executor before the next step (``slot_ops``); the
workers' ``LoRASlots`` (``slots.py``) hold the device stacks. A slot evicted (least recently
used first) is never one that a running request uses: the scheduler names those (``busy``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from epdserve.engine.lora.digest import read_weights
from epdserve.engine.lora.peft_files import inspect_adapter, load_adapter
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.lora.slots import LoRAModuleWeights, LoRASlotLoad, encode_weights
from epdserve.engine.models.config import ModelConfig

log = logging.getLogger("epdserve.lora")

MAX_FAILURES_KEPT = 256


class LoRALoadError(ValueError):
    """An adapter's files could not be read into the engine (the request gets a 400)."""


class LoRAManager:
    """Adapters by int id: being read, on the host, on device slots (the slot table only: the
    weights are the workers'). ``slot_ops`` lists what the workers must do before the next
    step, in order: a ``LoRASlotLoad``, or the int of a slot to clear."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int):
        self.cfg, self.max_rank, self.max_cpu_loras = cfg, max_rank, max_cpu_loras
        self.slot_owner: list[int | None] = [None] * max_loras
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self.names: dict[int, str] = {}  # lora id -> name, of adapters on slots
        self.keys: dict[int, str] = {}  # lora id -> content key, of adapters on slots
        # host weights by content (the digest of the files): names over the same files share
        # one read and one entry; at most ``max_cpu_loras`` entries, least recently used out
        self.host: OrderedDict[str, tuple[float, list[LoRAModuleWeights]]] = OrderedDict()
        self.loading: dict[str, Future] = {}  # reads in flight, at most ``max_cpu_loras``
        self.failed: OrderedDict[str, str] = OrderedDict()
        self.slot_ops: list[LoRASlotLoad | int] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.num_loads = self.num_slot_writes = 0

    @property
    def max_loras(self) -> int:
        return len(self.slot_owner)

    # --- host side ---------------------------------------------------------------------
    @staticmethod
    def content_key(lora: LoRARequest) -> str:
        """What the host side knows an adapter by: its files' digest (an adapter made by a
        caller without one: its id)."""
        return lora.digest or f"id:{lora.lora_int_id}"

    def prefetch(self, lora: LoRARequest) -> None:
        """Start reading ``lora`` unless its files are read, being read, or failed, or the
        reads in flight are at their bound (it is then read when a request needs it)."""
        self._collect()
        key = self.content_key(lora)
        if key in self.host or key in self.loading or key in self.failed:
            return
        if len(self.loading) >= self.max_cpu_loras:
            return
        self.loading[key] = self._pool.submit(self._read, lora)

    def _read(self, lora: LoRARequest) -> tuple[float, list[LoRAModuleWeights]]:
        spec = inspect_adapter(lora.lora_path, self.cfg, self.max_rank)
        data, digest = read_weights(lora.lora_path)
        if lora.digest is not None and digest != lora.digest:
            raise ValueError(
                "lora_path: the adapter's files changed since it was loaded; load it again "
                "(unload, then /v1/load_lora_adapter) to serve the new files"
            )
        return spec.scaling, encode_weights(load_adapter(spec, data))

    def _collect(self, last: str | None = None) -> None:
        """Move finished reads to the host LRU (``last`` the most recent of them)."""
        done = [k for k, f in self.loading.items() if f.done() and k != last]
        if last is not None and last in self.loading and self.loading[last].done():
            done.append(last)
        for key in done:
            future = self.loading.pop(key)
            try:
                weights = future.result()
            except Exception as exc:
                reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                self.failed[key] = reason
                while len(self.failed) > MAX_FAILURES_KEPT:
                    self.failed.popitem(last=False)
                log.warning("LoRA adapter files %s failed to load: %s", key, reason)
                continue
            self.num_loads += 1
            self.host[key] = weights
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)

    def _host_weights(self, lora: LoRARequest) -> tuple[float, list[LoRAModuleWeights]] | None:
        """The adapter's host weights; None while being read. ``LoRALoadError`` if unreadable."""
        key = self.content_key(lora)
        self._collect(last=key)
        if key in self.failed:
            raise LoRALoadError(f"LoRA adapter {lora.lora_name!r}: {self.failed[key]}")
        if key in self.host:
            self.host.move_to_end(key)
            return self.host[key]
        self.prefetch(lora)
        return None

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
        lid = lora.lora_int_id
        self.slot_ops.append(LoRASlotLoad(slot, lid, *weights))
        self.num_slot_writes += 1
        self.slot_owner[slot] = lid
        self.slots[lid] = slot
        self.names[lid] = lora.lora_name
        self.keys[lid] = self.content_key(lora)
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
        """Take adapter ``lid`` off its slot (its weights stay in the workers' stacks until
        overwritten; no request may point at the slot)."""
        slot = self.slots.pop(lid, None)
        if slot is not None:
            self.slot_owner[slot] = None
            self.names.pop(lid, None)
            self.keys.pop(lid, None)

    def forget(self, lora: LoRARequest) -> None:
        """Drop adapter ``lora`` (no live request may use it): its slot (the workers clear
        it), a remembered failure of its files and their host weights, unless an adapter on a
        slot shares them."""
        slot = self.slots.get(lora.lora_int_id)
        self.release(lora.lora_int_id)
        if slot is not None:
            self.slot_ops.append(slot)
        key = self.content_key(lora)
        self.failed.pop(key, None)
        if key not in self.keys.values():
            self.host.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
