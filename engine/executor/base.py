"""The engine core's one handle on the model (DESIGN.md §10): an ``Executor`` drives one
``Worker`` per rank and hides how many there are and where they run.

Every rank runs the same methods (``RANK_METHODS``) with the same arguments; everything
passed and returned is msgpack-able, so an executor whose workers live in other processes
can ship it as bytes. ``collective_rpc`` is the one primitive a backend must provide; the
named methods below are built on it, and a backend may override one where it can do better
(``uni`` calls its worker directly on the step path).
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from typing import Any

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.interfaces import KVCacheConfig, ModelRunnerOutput, SchedulerOutput
from epdserve.engine.core.kv_cache_groups import KVCacheSpec
from epdserve.engine.lora.slots import LoRASlotLoad
from epdserve.engine.models.config import load_model_config
from epdserve.engine.models.layers import check_tensor_parallel

# the Worker methods an executor runs on every rank, in the order a core calls them
RANK_METHODS = (
    "load_model",
    "determine_available_memory",
    "initialize_kv_cache",
    "add_lora",
    "remove_lora",
    "execute_model",
    "shutdown",
)

# backend name -> "module:class" (imported when chosen)
EXECUTOR_BACKENDS = {
    "uni": "epdserve.engine.executor.uni:UniProcExecutor",
    "mp": "epdserve.engine.executor.mp:MultiprocExecutor",
}


class Executor(ABC):
    """Runs the workers of one engine. Construction loads the model on every rank; the core
    then sizes and allocates the KV cache through it and steps it."""

    output_rank = 0  # the rank whose ``ModelRunnerOutput`` the core gets

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Run ``Worker.<method>(*args)`` on every rank; their results in rank order.
        ``method`` must be one of ``RANK_METHODS``. Raises what a rank raised."""

    def determine_available_memory(self, spec: KVCacheSpec) -> int:
        """Bytes every rank can give a KV cache laid out as ``spec`` (the smallest of them:
        all ranks allocate the same number of blocks). Changes nothing."""
        return min(self.collective_rpc("determine_available_memory", (spec,)))

    def initialize_kv_cache(self, kv: KVCacheConfig) -> None:
        """Allocate ``kv.num_blocks`` blocks on every rank and the runners over them."""
        self.collective_rpc("initialize_kv_cache", (kv,))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the output rank's result. Mutates the workers' request
        states and KV caches as ``sched`` says."""
        return self.collective_rpc("execute_model", (sched,))[self.output_rank]

    def execute_model_async(self, sched: SchedulerOutput) -> StepHandle:
        """Start one step; its ``result()`` later (overlapped scheduling). The core waits
        for a step's result before it starts the next or calls anything else. This default
        runs the step now; a backend whose ranks run elsewhere returns at once."""
        cpu = time.process_time()
        try:
            output, error = self.execute_model(sched), None
        except Exception as exc:
            output, error = None, exc
        handle = StepHandle(output, error)
        handle.cpu_seconds = time.process_time() - cpu
        return handle

    def add_lora(self, load: LoRASlotLoad) -> None:
        """Write an adapter onto device slot ``load.slot`` of every rank."""
        self.collective_rpc("add_lora", (load,))

    def remove_lora(self, slot: int) -> None:
        """Clear device slot ``slot`` on every rank (its adapter was unloaded)."""
        self.collective_rpc("remove_lora", (slot,))

    def check_health(self) -> None:
        """Raise ``WorkerFailure`` if a rank is gone (the core checks while idle)."""
        return  # in-process ranks live as long as the core

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank and release what it holds (stores, processes). Idempotent."""


class StepHandle:
    """A step started by ``execute_model_async``: ``result()`` waits for its output, or
    raises what the step raised."""

    cpu_seconds = 0.0  # this process's CPU time while the model ran (known once done)

    def __init__(self, output: ModelRunnerOutput | None = None, error: Exception | None = None):
        self._output, self._error = output, error

    def result(self) -> ModelRunnerOutput:
        if self._error is not None:
            raise self._error
        return self._output


def check_rank_method(method: str) -> None:
    """Refuse a method that is not one every rank runs (names the argument)."""
    if method not in RANK_METHODS:
        raise ValueError(f"method: {method!r} is not one of the workers' {RANK_METHODS}")


def create_executor(config: EngineConfig, backend: str | None = None) -> Executor:
    """The executor of ``backend`` (default: the config's ``distributed_executor_backend``)
    over ``config`` (resolved: identity, ``max_model_len``), with the model loaded on every
    rank. A tensor-parallel size the model cannot be split by is refused before any rank
    starts, naming the flag."""
    backend = backend or config.distributed_executor_backend or "uni"
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {sorted(EXECUTOR_BACKENDS)}")
    check_tensor_parallel(load_model_config(config.model), config.tensor_parallel_size)
    module, name = EXECUTOR_BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module), name)(config)
