"""``ModelCpuClock``: the process CPU time is read on a step at most every interval, and the
steps between are estimated from their wall time at the last read step's CPU/wall ratio."""

from __future__ import annotations

import pytest

from epdserve.engine.core import cpu_clock


class FakeTime:
    """Wall and process clocks the test moves by hand; counts the process-clock reads."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.reads = 0

    def perf_counter(self) -> float:
        return self.wall

    def process_time(self) -> float:
        self.reads += 1
        return self.cpu

    def step(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(cpu_clock, "time", fake)
    return cpu_clock.ModelCpuClock(interval_s=1.0), fake


def test_the_first_step_is_read_and_later_ones_estimated_at_its_ratio(clock):
    clock, t = clock
    mark = clock.start()
    t.step(wall=0.010, cpu=0.015)  # 1.5 threads busy
    assert clock.seconds(mark) == pytest.approx(0.015) and t.reads == 2
    mark = clock.start()
    t.step(wall=0.020, cpu=0.022)  # not read: 1.5 x its wall time
    assert clock.seconds(mark) == pytest.approx(0.030) and t.reads == 2


def test_a_step_after_the_interval_is_read_again_and_sets_the_ratio(clock):
    clock, t = clock
    mark = clock.start()
    t.step(wall=0.5, cpu=0.5)
    clock.seconds(mark)
    t.step(wall=0.6, cpu=0.0)  # idle between steps: past the 1 s interval
    mark = clock.start()
    t.step(wall=0.1, cpu=0.2)
    assert clock.seconds(mark) == pytest.approx(0.2) and t.reads == 4
    mark = clock.start()
    t.step(wall=0.1, cpu=0.1)
    assert clock.seconds(mark) == pytest.approx(0.2)  # at the new ratio, 2.0
