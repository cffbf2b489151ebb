"""``uni``: one worker in the core's own process, the default at tensor-parallel size 1.

Arguments pass by reference (no encoding), and the step path calls the worker directly, so
a step costs what calling the model runner did before the executor existed
(``bench/executor_overhead.py`` measures it).
"""

from __future__ import annotations

from typing import Any

from epdserve.engine.config import EngineConfig
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

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        check_rank_method(method)
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)  # the per-step path: no dispatch by name

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.worker.shutdown()
