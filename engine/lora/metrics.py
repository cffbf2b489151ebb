"""LoRA metrics of a pod: vLLM's ``vllm:lora_requests_info`` (which adapters run and wait,
as labels; the value is when that was last true) and requests finished per served adapter."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from epdserve.engine.core.interfaces import SchedulerStats


class LoRAMetrics:
    """``served`` is the pod's adapters by name, a live view (the LoRA registry's dict): a
    request that finishes after its adapter was unloaded is not counted, since its series
    would come back and, the name no longer served, never go."""

    def __init__(
        self,
        registry: CollectorRegistry,
        max_loras: int,
        labels: dict[str, str],
        served: Mapping[str, object],
    ):
        self.max_lora = str(max_loras)
        self.labels = labels
        self.served = served
        self.info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        )
        self.finished = Counter(
            "epdserve:lora_requests",
            "Requests finished per LoRA adapter.",
            [*labels, "lora_name"],
            registry=registry,
        )
        self._shown: tuple[str, str] | None = None
        self.on_stats(SchedulerStats())  # exported from the start, as vLLM does

    def on_stats(self, stats: SchedulerStats) -> None:
        """One series: the adapters now (a changed set replaces the previous series, so the
        page stays one line however many sets there have been)."""
        shown = (",".join(stats.waiting_loras), ",".join(stats.running_loras))
        if shown != self._shown and self._shown is not None:
            self.info.remove(self.max_lora, *self._shown)
        self._shown = shown
        self.info.labels(self.max_lora, *shown).set(time.time())

    def on_finished(self, lora_name: str) -> None:
        if lora_name in self.served:
            self.finished.labels(**self.labels, lora_name=lora_name).inc()

    def on_unloaded(self, lora_name: str) -> None:
        """The adapter is no longer served: its series go, so a pod that loads and unloads
        adapters for weeks exports only those it serves."""
        with contextlib.suppress(KeyError):  # none of its requests finished (older clients raise)
            self.finished.remove(*self.labels.values(), lora_name)
