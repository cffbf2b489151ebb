"""Which serving defaults win on this machine: ``epdserve serve`` started alone with each
candidate value of one knob (the others at their defaults), loaded by ``vllm bench serve``
with the cases of ``bench/vs_vllm.py`` (random 128/128 x 64, and with a 512-token shared
prefix), candidates in alternating order over rounds. Prints one JSON object: per knob and
value, the median output tok/s and TTFT p50 of each case.

    python bench/defaults_sweep.py [--rounds 2] [--preset tiny] [--knob block-size=16,32,64,128 ...]
        [--knob max-num-batched-tokens=2048,4096] [--knob OMP_NUM_THREADS=1,2]

A knob in capitals is an environment variable, else a ``serve`` flag. Needs vLLM's venv for
the client (``bench/vs_vllm.py`` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import vs_vllm_env as env
import vs_vllm_settings as sets
from vs_vllm import median
from vs_vllm_serve import CASES, run_server

DEFAULT_KNOBS = ["block-size=16,32,64,128", "max-num-batched-tokens=2048,4096"]


def candidates(knob: str) -> tuple[str, list[str]]:
    name, _, values = knob.partition("=")
    return name, values.split(",")


def start_args(name: str, value: str) -> tuple[list[str], dict[str, str]]:
    """Extra serve flags and environment of one candidate."""
    if name.isupper():
        return [], {name: value}
    return ["--" + name, value], {}


def sweep(vllm_python: str, model: Path, knob: str, rounds: int, tmp: Path) -> dict:
    name, values = candidates(knob)
    plan = [(CASES[c][0], 100 * (i + 1) + r) for r in range(rounds) for i, c in enumerate(CASES)]
    runs: dict[str, list[dict]] = {v: [] for v in values}
    for r in range(rounds):
        for value in values if r % 2 == 0 else values[::-1]:
            flags, extra = start_args(name, value)
            base = sets.serve_flags("defaults", "epdserve")
            env_ = {**sets.base_env(), **extra}
            runs[value] += run_server(vllm_python, model, "epdserve", base + flags, env_, tmp,
                                      plan[r * len(CASES) : (r + 1) * len(CASES)])  # fmt: skip
    out = {}
    for value, results in runs.items():
        by_case = {c: results[i :: len(CASES)] for i, c in enumerate(CASES)}
        out[value] = {
            case: {
                "output_throughput": round(median([x["output_throughput"] for x in rs]), 1),
                "median_ttft_ms": round(median([x["median_ttft_ms"] for x in rs]), 1),
                "runs": [round(x["output_throughput"]) for x in rs],
            }
            for case, rs in by_case.items()
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--knob", action="append", default=None)
    ap.add_argument("--preset", default="tiny", choices=sets.PRESETS)
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get(
        "EPDSERVE_VLLM_VENV", env.DEFAULT_VENV)))  # fmt: skip
    args = ap.parse_args()
    versions, why = env.ensure_vllm(args.vllm_venv, install=False)
    if versions is None:
        print(json.dumps({"skipped": f"no vLLM client: {why}"}))
        return
    python = str(env.venv_python(args.vllm_venv))
    started = time.time()
    result = {"base_flags": sets.serve_flags("defaults", "epdserve"), "rounds": args.rounds}
    result["preset"], result["cpu"] = args.preset, env.cpu_info()
    with tempfile.TemporaryDirectory() as tmp:
        model = env.make_checkpoint(Path(tmp) / f"{args.preset}-llama-bf16", args.preset)
        for knob in args.knob or DEFAULT_KNOBS:
            result[knob] = sweep(python, model, knob, args.rounds, Path(tmp))
    result["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
