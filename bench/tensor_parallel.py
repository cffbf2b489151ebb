"""Tensor parallelism on this machine, side by side with vLLM's CPU build (one JSON object).

(a) offline, per ``--presets`` checkpoint (bf16, ``vs_vllm_settings``): our ``LLM`` at TP 1
    (one process, every CPU) and at TP 2 (a worker process per rank, a core each), and
    vLLM's at TP 1 and TP 2, each engine alone, in alternating order, ``--rounds`` generates
    each (the same seeds for all); output tok/s medians and ratios.
    vLLM at TP 2 on this machine needs two things a user must give it: its default thread
    binding refuses a second worker on one NUMA node ("Not enough allowed NUMA nodes"), so
    ``VLLM_CPU_OMP_THREADS_BIND=0|1``; and its KV default (a share of the node's memory per
    worker) runs the two workers out of memory, so ``kv_cache_memory_bytes`` = 1 GiB, which
    every case gets (ours: the same bytes per rank).
(b) served, per preset: ``epdserve serve -tp 2`` against ``-tp 1`` and ``vllm serve -tp 2``
    (same flags as (a)), loaded by ``vllm bench serve`` (``vs_vllm_serve``: 64 prompts,
    128 in / 128 out, all at once).
(c) the cost of TP itself: the executor's round trip of an empty step (the shared-memory
    ring out, every rank's reply back) at TP 2 against the in-process TP 1; and a gloo
    all-reduce of a ``[rows, hidden]`` bf16 activation between two processes pinned to a
    core each, per call, per layer (two: after o and after down) and per decode step.

    python bench/tensor_parallel.py [--rounds 3] [--quick] [--presets tiny qwen2.5-0.5b]
        [--skip offline served costs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import vs_vllm_env as env
import vs_vllm_settings as sets
from vs_vllm import offline_runs
from vs_vllm_serve import CASES, run_server

HERE = Path(__file__).resolve().parent
KV = 1 << 30
BIND_TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def cases(tp: int) -> dict[str, tuple[dict, dict]]:
    """engine -> (``LLM`` kwargs beyond the user's flags, extra environment) at ``tp``."""
    ours = {"tensor_parallel_size": tp, "kv_cache_memory": KV}
    vllm = {"tensor_parallel_size": tp, "kv_cache_memory_bytes": KV}
    if tp > 1:
        vllm["distributed_executor_backend"] = "mp"
    return {"epdserve": (ours, {}), "vllm": (vllm, BIND_TP2 if tp > 1 else {})}


def offline(vllm_python: str, model: Path, args, work: dict) -> dict:
    pythons = {"epdserve": sys.executable, "vllm": vllm_python}
    cmds = [{"seed": 1000 + r, "prompts": work["prompts"], "prompt_len": work["input"],
             "output_len": work["output"]} for r in range(args.rounds)]  # fmt: skip
    out: dict[str, dict] = {}
    order = [(name, tp) for tp in (1, 2) for name in ("epdserve", "vllm")]
    for name, tp in order if not args.vllm_first else order[::-1]:
        kwargs, extra = cases(tp)[name]
        env_ = {**sets.base_env(), **extra}
        runs = offline_runs(pythons[name], name, model, dict(sets.USER_FLAGS, seed=0, **kwargs),
                            env_, cmds)  # fmt: skip
        tok_s = [r["output_tok_per_s"] for r in runs]
        out[f"{name}_tp{tp}"] = {"output_tok_per_s": tok_s, "median": statistics.median(tok_s)}
    med = {k: v["median"] for k, v in out.items()}
    out["ratios"] = {
        "ours_tp2_over_tp1": round(med["epdserve_tp2"] / med["epdserve_tp1"], 3),
        "ours_tp2_over_vllm_tp2": round(med["epdserve_tp2"] / med["vllm_tp2"], 3),
        "ours_tp1_over_vllm_tp1": round(med["epdserve_tp1"] / med["vllm_tp1"], 3),
        "vllm_tp2_over_tp1": round(med["vllm_tp2"] / med["vllm_tp1"], 3),
    }
    return out


def served(vllm_python: str, model: Path, args, tmp: Path) -> dict:
    shape = CASES["random"][1 if args.quick else 0]
    runs = [(shape, 100 + r) for r in range(args.rounds)]
    flags = sets.serve_flags("defaults", "epdserve")
    out = {}
    for name, tp in (("epdserve", 1), ("epdserve", 2), ("vllm", 2)):
        extra_flags = ["--tensor-parallel-size", str(tp)]
        if name == "vllm":
            extra_flags += [
                "--kv-cache-memory-bytes",
                str(KV),
                "--distributed-executor-backend",
                "mp",
            ]
        else:
            extra_flags += ["--kv-cache-memory", str(KV)]
        env_ = {**sets.base_env(), **(BIND_TP2 if name == "vllm" else {})}
        res = run_server(vllm_python, model, name, flags + extra_flags, env_, tmp, runs)
        out[f"{name}_tp{tp}"] = {
            k: statistics.median(r[k] for r in res)
            for k in ("output_throughput", "median_ttft_ms", "median_itl_ms")
        }
    ours, ours1, theirs = out["epdserve_tp2"], out["epdserve_tp1"], out["vllm_tp2"]
    out["ratios"] = {
        "ours_tp2_over_vllm_tp2": round(ours["output_throughput"] / theirs["output_throughput"], 3),
        "ours_tp2_over_tp1": round(ours["output_throughput"] / ours1["output_throughput"], 3),
        "ttft_p50_ours_tp2_over_vllm_tp2": round(ours["median_ttft_ms"] / theirs["median_ttft_ms"], 3),
        "itl_p50_ours_tp2_over_vllm_tp2": round(ours["median_itl_ms"] / theirs["median_itl_ms"], 3),
    }  # fmt: skip
    return out


def step_round_trip(model: Path, n: int = 2000) -> dict:
    """Microseconds per empty step through each executor (median of ``n``)."""
    from epdserve.engine import LLM
    from epdserve.engine.core.interfaces import CachedRequestData, SchedulerOutput

    empty = SchedulerOutput([], CachedRequestData([], [], []), {}, 0, [])
    out = {}
    for tp in (1, 2):
        llm = LLM(model=str(model), tensor_parallel_size=tp, dtype="bfloat16", max_model_len=2048)
        ex = llm.engine.executor
        times = []
        for _ in range(n):
            t = time.perf_counter()
            ex.execute_model(empty)
            times.append(time.perf_counter() - t)
        out[f"tp{tp}_us"] = round(statistics.median(times) * 1e6, 1)
        llm.engine.close()
    return out


def allreduce_rank(rank: int, init: str, hidden: int, rows: list[int], n: int) -> None:
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, [rank % os.cpu_count()])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from epdserve.engine.worker.parallel import join_shm_collectives

    shm = join_shm_collectives(rank, 2, f"epdserve-bench-{init.rsplit(':', 1)[1]}", 60.0)
    out: dict[str, dict] = {"gloo": {}, "shm": {}}
    for kind, reduce in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
        for r in rows:
            t_ = torch.randn(r, hidden).to(torch.bfloat16)
            for _ in range(20):
                reduce(t_)
            times = []
            for _ in range(n):
                t = time.perf_counter()
                reduce(t_)
                times.append(time.perf_counter() - t)
            out[kind][str(r)] = round(statistics.median(times) * 1e6, 1)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def allreduce_costs(hidden: int, layers: int, n: int = 300) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    rows = [1, 8, 32, 64, 512]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--allreduce-rank",
                str(r),
                "--init",
                init,
                "--hidden",
                str(hidden),
                "--rows",
                *map(str, rows),
                "--n",
                str(n),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    per_call = json.loads(procs[0].communicate()[0])
    procs[1].wait()
    return {
        "hidden": hidden,
        "layers": layers,
        "per_call_us": per_call,
        "per_decode_step_ms_at_rows": {
            kind: {r: round(us * 2 * layers / 1000, 3) for r, us in calls.items() if int(r) <= 64}
            for kind, calls in per_call.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--presets", nargs="+", default=["tiny", "qwen2.5-0.5b"], choices=sets.PRESETS)
    ap.add_argument("--skip", nargs="*", default=[], choices=("offline", "served", "costs"))
    ap.add_argument("--vllm-first", type=int, default=0, choices=(0, 1))
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get(
        "EPDSERVE_VLLM_VENV", Path.home() / ".cache/epdserve/vllm-venv")))  # fmt: skip
    ap.add_argument("--allreduce-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.allreduce_rank is not None:
        return allreduce_rank(args.allreduce_rank, args.init, args.hidden, args.rows, args.n)
    versions, why = env.ensure_vllm(args.vllm_venv, install=True)
    vllm_python = str(env.venv_python(args.vllm_venv))
    result = {"versions": env.versions(versions), "cpu": env.cpu_info()}
    result["loadavg_before"] = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            entry = result.setdefault(preset, {})
            model = env.make_checkpoint(Path(tmp) / f"{preset}-llama-bf16", preset)
            from epdserve.engine.models.config import load_model_config

            cfg = load_model_config(model)
            if "costs" not in args.skip:
                entry["step_round_trip"] = step_round_trip(model, 300 if args.quick else 2000)
                entry["allreduce"] = allreduce_costs(cfg.hidden_size, cfg.num_layers)
            if "offline" not in args.skip and versions is not None:
                work = sets.offline_workload(preset, args.quick)
                entry["offline_workload"] = work
                entry["offline"] = offline(vllm_python, model, args, work)
            if "served" not in args.skip and versions is not None:
                entry["served"] = served(vllm_python, model, args, Path(tmp))
            shutil.rmtree(model, ignore_errors=True)
    if versions is None:
        result["vllm_skipped"] = why
    result["wall_s"] = round(time.time() - started, 1)
    result["loadavg_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
