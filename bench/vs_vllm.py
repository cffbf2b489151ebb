"""epdserve side by side with vLLM's CPU build, same checkpoint, same machine (one JSON object).

(a) offline: 64 prompts x 128 tokens, ``vllm.LLM.generate`` vs our ``LLM.generate``;
(b) served: ``vllm serve`` vs ``epdserve serve``, both loaded by the same client, ``vllm bench
    serve --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 64
    --request-rate inf --ignore-eos``: req/s, output tok/s, TTFT and ITL percentiles;
(c) served, shared prefix: the same client with ``--random-prefix-len`` (one prefix for every
    prompt of a round), prefix caching on in both.

Cases alternate within each round (the order flips every round); each round uses its own seed,
the same for both engines, so no round reuses another's cached prefixes. Medians over rounds,
ratios ours / vLLM's. Both engines: the ``tiny`` make-model Llama stored in bf16, dtype bfloat16,
block size 32 (vLLM's CPU minimum), max_model_len 1024, 256 seqs, 2048 batched tokens, 1 GiB of
KV cache, and the same thread settings (``vs_vllm_env.thread_env``). vLLM runs from its own venv
(installed there on first use; skipped with a message where that fails).

    python bench/vs_vllm.py [--rounds 3] [--quick] [--vllm-venv DIR] [--no-install]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import vs_vllm_env as env
from vs_vllm_serve import ServedPair

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


class OfflineWorker:
    """``vs_vllm_offline.py`` in one venv: loaded once, one generate per command."""

    def __init__(self, python: str, engine: str, model: Path, threads: int):
        # -P: bench/ stays off sys.path (bench/kernels.py would shadow the `kernels` package)
        cmd = [python, "-P", str(HERE / "vs_vllm_offline.py"), "--engine", engine]
        cmd += ["--model", str(model)]
        self.log = model.parent / f"offline-{engine}.log"
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),  # noqa: SIM115 (the child holds it)
            text=True,
            env={**os.environ, **env.thread_env(threads)},
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


def offline(vllm_python: str, model: Path, args) -> dict:
    workers = {
        "epdserve": OfflineWorker(sys.executable, "epdserve", model, args.threads),
        "vllm": OfflineWorker(vllm_python, "vllm", model, args.threads),
    }
    runs: dict[str, list[dict]] = {"epdserve": [], "vllm": []}
    try:
        for r in range(-1, args.rounds):  # round -1: warm-up at full size, not counted
            cmd = {"seed": 1000 + r, "prompts": args.prompts}
            cmd.update(prompt_len=args.input_len, output_len=args.output_len)
            for name in round_order(r):
                other = workers["vllm" if name == "epdserve" else "epdserve"].proc.pid
                quiet_wait = env.wait_quiet([w.proc.pid for w in workers.values()])
                idle = env.process_cpu(other)
                res = workers[name].run(cmd)
                res["other_engine_idle_cpu_s"] = env.cpu_delta(idle, env.process_cpu(other))
                res["waited_for_quiet_s"] = quiet_wait
                if r >= 0:
                    runs[name].append(res)
    finally:
        for w in workers.values():
            w.close()
    return compare(runs["epdserve"], runs["vllm"], ("output_tok_per_s",))


def served(vllm_python: str, model: Path, args) -> tuple[dict, dict]:
    pair = ServedPair(vllm_python, model, args.serve_threads, quick=args.quick)
    runs = {case: {"epdserve": [], "vllm": []} for case in ("random", "shared_prefix")}
    try:
        pair.start()
        for r in range(-1, args.rounds):  # round -1: warm-up, not counted
            for i, case in enumerate(("random", "shared_prefix")):
                order = round_order(r + i)
                for name in order:
                    res = pair.bench(name, case, seed=100 * (i + 1) + r, args=args)
                    if r >= 0:
                        runs[case][name].append(res)
    finally:
        pair.stop()
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "median_itl_ms")
    return (
        compare(runs["random"]["epdserve"], runs["random"]["vllm"], keys),
        compare(runs["shared_prefix"]["epdserve"], runs["shared_prefix"]["vllm"], keys),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 rounds, 16 prompts x 32 tokens")
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get(
        "EPDSERVE_VLLM_VENV", env.DEFAULT_VENV)))  # fmt: skip
    ap.add_argument("--no-install", action="store_true", help="never install vLLM")
    cpus = len(os.sched_getaffinity(0))
    ap.add_argument("--threads", type=int, default=cpus, help="offline: OpenMP threads, both")
    ap.add_argument(
        "--serve-threads",
        type=int,
        default=max(1, cpus - 1),
        help="served: OpenMP threads of each engine's model process (both); default all CPUs "
        "but one, what each engine picks by itself on this machine",
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=("offline", "served"))
    args = ap.parse_args()
    args.prompts, args.input_len, args.output_len = (16, 128, 32) if args.quick else (64, 128, 128)
    if args.quick:
        args.rounds = min(args.rounds, 2)
    versions, why = env.ensure_vllm(args.vllm_venv, install=not args.no_install)
    import torch

    import epdserve

    result = {
        "versions": {
            "epdserve": getattr(epdserve, "__version__", "git"),
            "our_torch": torch.__version__,
            "vllm_and_its_torch": versions,
        },
        "threads": {
            "offline": env.thread_env(args.threads),
            "served_model_process": env.thread_env(args.serve_threads),
            "cpus": cpus,
            "pinning": "none (VLLM_CPU_OMP_THREADS_BIND=nobind; ours never pins)",
        },
        "rounds": args.rounds,
        "workload": {"prompts": args.prompts, "input": args.input_len, "output": args.output_len},
    }
    if versions is None:
        result["skipped"] = f"vLLM unavailable: {why}"
        print(json.dumps(result, indent=2))
        return
    vllm_python = str(env.venv_python(args.vllm_venv))
    started = time.time()
    result["started_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    result["loadavg_1_5_15"] = {"before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        model = env.make_checkpoint(Path(tmp) / "tiny-llama-bf16", "tiny")
        result["model"] = "make-model llama tiny seed 0, bf16 safetensors"
        if "offline" not in args.skip:
            result["a_offline"] = offline(vllm_python, model, args)
        if "served" not in args.skip:
            result["b_served_random"], result["c_served_shared_prefix"] = served(
                vllm_python, model, args
            )
    result["ratios"] = headline(result)
    result["wall_s"] = round(time.time() - started, 1)
    result["loadavg_1_5_15"]["after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


def headline(result: dict) -> dict:
    """The three ratios (output throughput, ours / vLLM's) and served TTFT p50 next to them."""
    out = {}
    for key, metric in (
        ("a_offline", "output_tok_per_s"),
        ("b_served_random", "output_throughput"),
        ("c_served_shared_prefix", "output_throughput"),
    ):
        if key in result:
            ratios = result[key]["ratio_ours_over_vllm"]
            out[key] = round(ratios[metric], 3)
            if "median_ttft_ms" in ratios:
                out[key + "_ttft_p50"] = round(ratios["median_ttft_ms"], 3)
    return out


if __name__ == "__main__":
    main()
