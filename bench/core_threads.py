"""How many OpenMP threads the served engine core should run, per model size: ``epdserve
serve`` started alone with each thread count (and once as a user starts it, the default),
loaded by the aiohttp generator of ``bench/serve.py`` (random prompts, streamed), counts in
alternating order over rounds. Prints one JSON object: per model and thread count, the
median output tok/s, TTFT p50 and ITL p50, and the ratio of each count to the default.

    python bench/core_threads.py --model DIR [--model DIR ...] [--threads 1 2] [--rounds 2]
        [--requests 64] [--prompt-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve import make_workload, run_load, serve  # noqa: E402

from epdserve.engine.cpus import core_threads_env  # noqa: E402
from epdserve.kernels.native_build import cpu_flags  # noqa: E402

DEFAULT = "default"


def one_run(model: str, threads: str, reqs, args) -> dict:
    """One server start with ``threads`` (``default``: as a user starts it), one load."""
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    if threads != DEFAULT:
        os.environ["OMP_NUM_THREADS"] = threads
    try:
        proc, url = serve(model, args)
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved
    try:
        asyncio.run(run_load(url, reqs[:4], None, None))  # warm-up: kernels built, caches hot
        return asyncio.run(run_load(url, reqs, args.concurrency, None))
    finally:
        proc.terminate()
        proc.wait(60)


def summary(runs: list[dict]) -> dict:
    return {
        "output_tok_per_s": statistics.median(r["output_tok_per_s"] for r in runs),
        "ttft_p50_ms": statistics.median(r["ttft"]["p50_ms"] for r in runs),
        "itl_p50_ms": statistics.median(r["itl"]["p50_ms"] for r in runs),
        "runs": len(runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--threads", nargs="*", default=["1", "2"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-mb", type=int, default=1024)
    args = ap.parse_args()
    flags = cpu_flags()
    out = {
        "cpu": {f: f in flags for f in ("amx_bf16", "avx512_bf16")} | {"cpus": os.cpu_count()},
        "workload": vars(args),
        "models": {},
    }
    reqs = make_workload("random", args.requests, 0, args.prompt_len, args.output_len)
    counts = [DEFAULT, *args.threads]
    for model in args.model:
        results: dict[str, list] = {c: [] for c in counts}
        for r in range(args.rounds):
            for c in counts if r % 2 == 0 else counts[::-1]:
                results[c].append(one_run(model, c, reqs, args))
                print(f"{Path(model).name} threads={c}: {results[c][-1]['output_tok_per_s']:.0f}",
                      file=sys.stderr)  # fmt: skip
        table = {c: summary(v) for c, v in results.items()}
        table[DEFAULT]["threads"] = core_threads_env(model).get("OMP_NUM_THREADS", "env")
        base = table[DEFAULT]["output_tok_per_s"]
        for c in counts:
            table[c]["ratio_to_default"] = table[c]["output_tok_per_s"] / base
        out["models"][model] = table
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
