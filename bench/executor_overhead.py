"""What the executor seam costs per step at TP 1 (``uni``), side by side in one run (prints JSON).

Two measurements on one ``EngineCore`` over the tiny preset (``epdserve make-model``):

- ``step_ms``: whole decode steps (``core.step()``: schedule, execute, update) with the core
  going through its executor (``executor``: core → ``UniProcExecutor`` → ``Worker`` →
  ``ModelRunner``) and with the core calling the runner itself, as it did before the seam
  (``direct``). Rounds alternate the two so drift in the machine hits both alike; medians.
- ``seam_ns``: the seam alone, with the runner's step replaced by one that returns at once:
  nanoseconds per ``executor.execute_model(sched)`` against the same stub called directly.

    .venv/bin/python bench/executor_overhead.py [--batch 8] [--steps 64] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def decode_step_times(core, batch: int, steps: int, tag: str) -> list[float]:
    """Seconds of each of ``steps`` decode-only steps of ``batch`` running requests."""
    from epdserve.engine.core.engine_core import EngineCoreRequest
    from epdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, req_id in enumerate(ids):
        core.add_request(EngineCoreRequest(req_id, [10 + i, 11, 12, 13, 14, 15, 16, 17], params))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # prefill (and a first token) for every request
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    core.abort_requests(ids)
    core.step()  # the runner drops their state
    return times


def step_ms(core, batch: int, steps: int, rounds: int) -> dict:
    executor = core.executor
    direct = SimpleNamespace(execute_model=executor.worker.runner.execute_model)
    samples = {"direct": [], "executor": []}
    for r in range(rounds):
        order = ("direct", "executor") if r % 2 == 0 else ("executor", "direct")
        for mode in order:
            core.executor = direct if mode == "direct" else executor
            samples[mode] += decode_step_times(core, batch, steps, f"{mode}{r}")
    core.executor = executor
    med = {m: statistics.median(v) * 1e3 for m, v in samples.items()}
    return {
        "direct": round(med["direct"], 4),
        "executor": round(med["executor"], 4),
        "difference": round(med["executor"] - med["direct"], 4),
        "steps_each": len(samples["direct"]),
    }


def seam_ns(core, iters: int) -> dict:
    from epdserve.engine.core.interfaces import (
        CachedRequestData,
        ModelRunnerOutput,
        SchedulerOutput,
    )

    runner = core.executor.worker.runner
    out = ModelRunnerOutput([], [])
    runner.execute_model = lambda sched: out  # the runner's own work taken out
    sched = SchedulerOutput([], CachedRequestData([], [], []), {}, 0, [])
    calls = {"direct": runner.execute_model, "executor": core.executor.execute_model}
    best = {}
    for mode, call in calls.items():
        runs = []
        for _ in range(5):
            t = time.perf_counter_ns()
            for _ in range(iters):
                call(sched)
            runs.append((time.perf_counter_ns() - t) / iters)
        best[mode] = min(runs)
    del runner.execute_model  # back to the class's method
    return {
        "direct": round(best["direct"], 1),
        "executor": round(best["executor"], 1),
        "difference": round(best["executor"] - best["direct"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=200_000)
    args = ap.parse_args()

    import torch

    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core.engine_core import EngineCore
    from epdserve.engine.make_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(args.arch, tmp, preset="tiny")
        core = EngineCore(EngineConfig(model=str(path), max_model_len=256))
        result = {
            "bench": "executor_overhead",
            "model": f"{args.arch} tiny",
            "device": core.config.device,
            "dtype": core.config.dtype,
            "torch_threads": torch.get_num_threads(),
            "batch": args.batch,
            "step_ms": step_ms(core, args.batch, args.steps, args.rounds),
            "seam_ns": seam_ns(core, args.iters),
        }
        core.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
