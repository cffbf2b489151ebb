"""``uni``: one worker in the core's own process, the default at tensor-parallel size 1.

Arguments pass by reference (no encoding), and the step path calls the worker directly, so
a step costs what calling the model runner did before the executor existed
(``bench/executor_overhead.py`` measures it). Overlapped scheduling runs the steps on one
background thread, in order (``execute_model_async``); the core thread meanwhile touches no
worker state.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.cpu_clock import ModelCpuClock
from epdserve.engine.core.interfaces import ModelRunnerOutput, SchedulerOutput
from epdserve.engine.executor.base import Executor, check_rank_method
from epdserve.engine.worker.worker import Worker


class UniProcExecutor(Executor):
    """Rank 0 only, in-process. ``worker`` is public for in-process tools (benches, tests)
    that time or inspect the model; the core never reads it."""

    def __init__(self, config: EngineConfig):
        self.worker = Worker(config, rank=0)
        self.worker.load_model()
        self._closed = False
        self._thread: ThreadPoolExecutor | None = None  # overlapped steps: made on first use
        self._cpu_clock = ModelCpuClock()  # the step thread's

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        check_rank_method(method)
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)  # the per-step path: no dispatch by name

    def execute_model_async(self, sched: SchedulerOutput) -> ThreadStep:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(
                1, thread_name_prefix="epdserve-step", initializer=self._on_device
            )
        return ThreadStep(self._thread.submit(self._timed_step, sched))

    def _on_device(self) -> None:
        """The step thread's current CUDA device is the worker's (a thread starts on 0)."""
        device = torch.device(self.worker.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def _timed_step(self, sched: SchedulerOutput) -> tuple[ModelRunnerOutput, float]:
        mark = self._cpu_clock.start()  # the process's CPU (every thread) while the model runs
        output = self.worker.execute_model(sched)
        return output, self._cpu_clock.seconds(mark)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._thread.shutdown(wait=True)  # a step in flight ends first
            self.worker.shutdown()


class ThreadStep:
    """A step running on the executor's thread; ``cpu_seconds`` is known once it is done."""

    def __init__(self, future: Future):
        self._future, self.cpu_seconds = future, 0.0

    def result(self) -> ModelRunnerOutput:
        output, self.cpu_seconds = self._future.result()
        return output
