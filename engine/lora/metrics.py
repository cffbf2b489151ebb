"""LoRA metrics of a pod: vLLM's ``vllm:lora_requests_info`` (which adapters run and wait,
as labels; the value is when that was last true) and requests finished per adapter."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from epdserve.engine.core.interfaces import SchedulerStats


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, max_loras: int, labels: dict[str, str]):
        self.max_lora = str(max_loras)
        self.labels = labels
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
        self.finished.labels(**self.labels, lora_name=lora_name).inc()
