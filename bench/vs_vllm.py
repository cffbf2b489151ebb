"""epdserve side by side with vLLM's CPU build, same checkpoint, same machine (one JSON object).

Every case runs per ``--presets`` checkpoint (default all three, ``vs_vllm_settings``): the
``tiny`` make-model Llama (overhead-bound) and Llamas shaped like Qwen2.5-0.5B and
Llama-3.2-1B, all stored in bf16. ``--arch mixtral`` or ``qwen3_moe`` runs the
mixture-of-experts checkpoints instead: ``tiny`` and the ``moe-0.6b`` shape. The JSON's ``presets`` holds each one's results and
``ratios``; its ``cpu`` block says whether the CPU has AMX and AVX512_BF16.

Each engine runs alone (the other stopped), in alternating order, in two settings
(``vs_vllm_settings``): ``defaults`` (each as a user starts it) and ``matched`` (the same block
size, batched-token budget, sequences and KV bytes). vLLM runs in each of its thread-binding
variants and the better one per case is kept (all are in the JSON).

(a) offline: 256 prompts x 128 tokens in, 128 out (the real shapes: 64 x 128 in, 64 out),
    ``vllm.LLM.generate`` vs our ``LLM.generate``: defaults, then matched at each
    ``--offline-threads`` count;
(b) served: ``vllm serve`` vs ``epdserve serve``, each loaded by ``vllm bench serve
    --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 64
    --request-rate inf --ignore-eos``: req/s, output tok/s, TTFT and ITL percentiles;
(c) served, shared prefix: the same with ``--random-prefix-len 512``.

Every load or server start gets a warm-up run first (not counted), then ``--rounds`` runs
(each round its own seed, the same for both engines; served cases alternate). Which engine
goes first alternates between settings, and ``--vllm-first 1`` flips it all for a second
run. Medians over rounds; ratios ours / vLLM's best variant. vLLM runs from its own venv
(installed there on first use; skipped with a message where that fails).

    python bench/vs_vllm.py [--rounds 3] [--quick] [--vllm-venv DIR] [--no-install]
        [--arch llama|mixtral|qwen3_moe] [--presets tiny qwen2.5-0.5b llama3.2-1b moe-0.6b] [--settings defaults matched]
        [--skip offline served] [--offline-threads 2 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import vs_vllm_env as env
import vs_vllm_settings as sets
from vs_vllm_serve import CASES, run_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
MARK = "@@RESULT "


def median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def summarize(runs: list[dict]) -> dict:
    """Per-metric medians over rounds (numeric fields only), plus the rounds themselves."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {"median": {k: median([r[k] for r in runs]) for k in keys}, "rounds": runs}


def compare(ours: list[dict], theirs: list[dict], keys: tuple[str, ...]) -> dict:
    """Both sides summarized, and ours / theirs of each key's median."""
    a, b = summarize(ours), summarize(theirs)
    ratios = {k: a["median"][k] / b["median"][k] for k in keys if b["median"].get(k)}
    return {"epdserve": a, "vllm": b, "ratio_ours_over_vllm": ratios}


def round_order(r: int) -> tuple[str, str]:
    return ("epdserve", "vllm") if r % 2 == 0 else ("vllm", "epdserve")


def best_variant(variants: dict[str, list[dict]], metric: str) -> str:
    """The variant with the highest median ``metric`` over its rounds."""
    return max(variants, key=lambda v: median([r[metric] for r in variants[v]]))


def compare_best(ours: list[dict], vllm: dict[str, list[dict]], keys, metric: str) -> dict:
    """``compare`` against vLLM's best variant by ``metric``; every variant's medians too."""
    best = best_variant(vllm, metric)
    out = compare(ours, vllm[best], keys)
    out["vllm_variant"] = best
    out["vllm_variants"] = {v: summarize(runs)["median"] for v, runs in vllm.items()}
    return out


class OfflineWorker:
    """``vs_vllm_offline.py`` in one venv: loaded once, one generate per command."""

    def __init__(self, python: str, engine: str, model: Path, kwargs: dict, env_: dict):
        # -P: bench/ stays off sys.path, so no bench script can shadow an installed package
        cmd = [python, "-P", str(HERE / "vs_vllm_offline.py"), "--engine", engine]
        cmd += ["--model", str(model), "--kwargs", json.dumps(kwargs)]
        self.log = model.parent / f"offline-{engine}.log"
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),  # noqa: SIM115 (the child holds it)
            text=True,
            env=env_,
        )
        self.read()  # ready

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        tail = self.log.read_text()[-3000:]
        raise RuntimeError(f"offline worker exited with code {self.proc.wait()}:\n{tail}")

    def run(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def offline_runs(python, name, model, kwargs, env_, cmds: list[dict]) -> list[dict]:
    """Load one engine alone, one full-size warm-up generate, then ``cmds``, exit."""
    started = time.monotonic()
    worker = OfflineWorker(python, name, model, kwargs, env_)
    load_s = round(time.monotonic() - started, 1)
    try:
        worker.run({**cmds[0], "seed": cmds[0]["seed"] + 10_000})
        results = [worker.run(cmd) for cmd in cmds]
    finally:
        worker.close()
    return [{**res, "load_s": load_s} for res in results]


def offline(vllm_python: str, model: Path, args, work: dict) -> dict:
    """Per setting: each engine variant loaded alone in turn (the first engine alternates
    between settings), ``rounds`` measured generates of ``work`` each, the same seeds."""
    out = {}
    pythons = {"epdserve": sys.executable, "vllm": vllm_python}
    cases = sets.offline_cases(args.cpus, args.offline_threads)
    for i, (setting, threads) in enumerate(cases):
        label = setting if threads is None else f"{setting}_{threads}_threads"
        cmds = [{"seed": 1000 + r, "prompts": work["prompts"], "prompt_len": work["input"],
                 "output_len": work["output"]} for r in range(args.rounds)]  # fmt: skip
        runs: dict[str, dict[str, list]] = {"epdserve": {}, "vllm": {}}
        for name in round_order(i + args.vllm_first):
            kwargs = sets.engine_kwargs(setting, name)
            for variant, extra in sets.variants(name, threads, args.cpus).items():
                env_ = {**sets.base_env(), **extra}
                runs[name][variant] = offline_runs(pythons[name], name, model, kwargs, env_, cmds)
        metric = "output_tok_per_s"
        out[label] = compare_best(runs["epdserve"]["default"], runs["vllm"], (metric,), metric)
    return out


def served(vllm_python: str, model: Path, args, index: int, setting: str) -> dict:
    """Both cases in one setting: each engine variant started alone in turn (the first
    engine alternates between settings), ``rounds`` runs of each case, cases alternating."""
    runs = {case: {"epdserve": {}, "vllm": {}} for case in CASES}
    tmp = Path(tempfile.mkdtemp(prefix="vs-vllm-serve-"))
    plan, order = [], []
    for r in range(args.rounds):
        cases = list(CASES) if r % 2 == 0 else list(CASES)[::-1]
        for case in cases:
            plan.append(
                (CASES[case][1 if args.quick else 0], 100 * (list(CASES).index(case) + 1) + r)
            )
            order.append(case)
    for name in round_order(index + args.vllm_first):
        flags = sets.serve_flags(setting, name)
        for variant, extra in sets.variants(name, None, args.cpus).items():
            env_ = {**sets.base_env(), **extra}
            results = run_server(vllm_python, model, name, flags, env_, tmp, plan)
            for case, res in zip(order, results, strict=True):
                runs[case][name].setdefault(variant, []).append(res)
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "median_itl_ms")
    metric = "output_throughput"
    return {
        case: compare_best(runs[case]["epdserve"]["default"], runs[case]["vllm"], keys, metric)
        for case in CASES
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round, 16 prompts x 32 tokens")
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get(
        "EPDSERVE_VLLM_VENV", env.DEFAULT_VENV)))  # fmt: skip
    ap.add_argument("--no-install", action="store_true", help="never install vLLM")
    ap.add_argument("--arch", default="llama", choices=sets.ARCHS,
                    help="make-model architecture of every preset's checkpoint")  # fmt: skip
    ap.add_argument("--presets", nargs="+", default=None, choices=sets.ALL_PRESETS,
                    help="make-model checkpoints to run every case on, in this order "
                         "(default: the architecture's, vs_vllm_settings.presets)")  # fmt: skip
    ap.add_argument("--offline-threads", type=int, nargs="*", default=[2, 1])
    ap.add_argument("--settings", nargs="*", default=list(sets.SETTINGS), choices=sets.SETTINGS)
    ap.add_argument("--skip", nargs="*", default=[], choices=("offline", "served"))
    ap.add_argument("--vllm-first", type=int, default=0, choices=(0, 1),
                    help="1: vLLM goes first in the first setting (a second run flips order)")  # fmt: skip
    args = ap.parse_args(argv)
    args.presets = args.presets or list(sets.presets(args.arch))
    args.cpus = sorted(os.sched_getaffinity(0))
    if args.quick:
        args.rounds = 1
    return args


def plan(args: argparse.Namespace) -> dict:
    """What a run measures, before it starts: the machine, the flags, each preset's model
    and offline workload (the served cases are ``vs_vllm_serve.CASES``)."""
    return {
        "cpu": env.cpu_info(),
        "cpus": args.cpus,
        "settings": {
            s: {"epdserve": sets.serve_flags(s, "epdserve"), "vllm": sets.serve_flags(s, "vllm")}
            for s in args.settings
        },  # fmt: skip
        "rounds": args.rounds,
        "first_setting_order": "vllm first" if args.vllm_first else "epdserve first",
        "presets": {
            p: {
                "model": f"make-model {args.arch} {p} seed 0, bf16 safetensors",
                "offline_workload": sets.offline_workload(p, args.quick),
            }
            for p in args.presets
        },  # fmt: skip
    }


def run_preset(vllm_python: str, preset: str, entry: dict, args, tmp: Path) -> None:
    """Every case on ``preset``'s checkpoint, results and ratios into ``entry``."""
    started = time.monotonic()
    model = env.make_checkpoint(tmp / f"{preset}-{args.arch}-bf16", preset, args.arch)
    entry["make_model_s"] = round(time.monotonic() - started, 1)
    if "offline" not in args.skip:
        entry["a_offline"] = offline(vllm_python, model, args, entry["offline_workload"])
    if "served" not in args.skip:
        entry["served"] = {
            s: served(vllm_python, model, args, i, s) for i, s in enumerate(args.settings)
        }
    entry["ratios"] = headline(entry)
    shutil.rmtree(model, ignore_errors=True)  # the 1B checkpoint is 2 GB


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    versions, why = env.ensure_vllm(args.vllm_venv, install=not args.no_install)
    result = {"versions": env.versions(versions), **plan(args)}
    if versions is None:
        result["skipped"] = f"vLLM unavailable: {why}"
        print(json.dumps(result, indent=2))
        return
    vllm_python = str(env.venv_python(args.vllm_venv))
    started = time.time()
    result["started_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    result["loadavg_1_5_15"] = {"before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for preset, entry in result["presets"].items():
            run_preset(vllm_python, preset, entry, args, Path(tmp))
    result["ratios"] = {p: entry["ratios"] for p, entry in result["presets"].items()}
    result["wall_s"] = round(time.time() - started, 1)
    result["loadavg_1_5_15"]["after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


def headline(result: dict) -> dict:
    """Every ratio, ours / vLLM's best variant: offline output tok/s per setting; served
    output tok/s and TTFT p50 per setting and case."""
    out = {}
    for label, cmp in result.get("a_offline", {}).items():
        out[f"offline_{label}"] = round(cmp["ratio_ours_over_vllm"]["output_tok_per_s"], 3)
    for setting, cases in result.get("served", {}).items():
        for case, cmp in cases.items():
            ratios = cmp["ratio_ours_over_vllm"]
            out[f"served_{setting}_{case}"] = round(ratios["output_throughput"], 3)
            if "median_ttft_ms" in ratios:
                out[f"served_{setting}_{case}_ttft_p50"] = round(ratios["median_ttft_ms"], 3)
    return out


if __name__ == "__main__":
    main()
