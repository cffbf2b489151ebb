"""The process CPU time the model takes, step by step, without two costly clock reads a step.

``time.process_time()`` sums the CPU time of every thread of the process. Right after a
parallel torch op, while its OpenMP threads still spin on the other cores, one read took
9 µs on a 2-CPU VM (0.8 µs otherwise; ``perf_counter`` 0.06 µs), and the two a step were
about a tenth of a 1-layer model's host time per decode step at batch 1. So the clock reads
the process CPU time on one step every ``interval_s`` seconds at most (the first step too)
and estimates each other step from its wall time at the CPU/wall ratio of the last step it
read. The first read showed the cost: one read in 8 steps was still 6% of that host time.
"""

from __future__ import annotations

import time

INTERVAL_S = 0.25


class ModelCpuClock:
    """``mark = clock.start()`` before a step runs, ``clock.seconds(mark)`` after it."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.next_read = 0.0  # perf_counter time from which a step's CPU is read again
        self.ratio = 1.0  # CPU seconds per wall second of the last step read (the first is)

    def start(self) -> tuple[float, float | None]:
        now = time.perf_counter()
        if now < self.next_read:
            return now, None
        self.next_read = now + self.interval_s
        return now, time.process_time()

    def seconds(self, mark: tuple[float, float | None]) -> float:
        """The step's process CPU seconds: read, or estimated from its wall time."""
        wall0, cpu0 = mark
        wall = time.perf_counter() - wall0
        if cpu0 is None:
            return wall * self.ratio
        cpu = time.process_time() - cpu0
        if wall > 0:
            self.ratio = cpu / wall
        return cpu
