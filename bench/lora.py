"""LoRA serving: mixed traffic over 4 adapters against base-only traffic, and side by side with
vLLM's CPU LoRA on the same adapters (one JSON object).

The ``tiny`` make-model Llama stored in bf16 (``vs_vllm_env.make_checkpoint``) and 4 random
PEFT adapters written next to it (``make-model --lora 4``'s writer: ranks 8, 16, 4, 8, every
attention and MLP projection). Each engine is started alone (the other stopped) with
``--enable-lora --max-loras 4 --max-lora-rank 16`` and the 4 adapters as ``--lora-modules``,
on top of ``bench/vs_vllm_settings.py``'s flags of ``--setting`` (default ``defaults``);
vLLM in each of its thread-binding variants (the best one kept per traffic, all recorded).

Traffic, the same client as ``bench/vs_vllm.py``'s served cases (``vllm bench serve
--dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 64
--request-rate inf --ignore-eos``, ``--quick``: 16 x 128/32):

- ``base``: every request names the base model;
- ``mixed``: the same prompts (same seed), requests spread round-robin over the 4 adapters
  (``--lora-modules lora0 .. lora3 --lora-assignment round-robin``).

Each server start: the adapters listed by ``/v1/models``, one greedy probe per model (does
each adapter change the output, and do both engines agree), one warm-up run of each traffic
(not counted), then ``--rounds`` rounds of both traffics (order flipping each round, each
round its own seed, the same for both engines). Medians over rounds. Ratios: ours mixed / ours
base (goal >= 0.7), ours / vLLM's best variant on mixed traffic (goal >= 1.0).

    python bench/lora.py [--rounds 2] [--quick] [--vllm-venv DIR] [--no-install]
        [--setting defaults|matched] [--vllm-first]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import vs_vllm_env as env
import vs_vllm_settings as sets
from vs_vllm import best_variant, median, summarize
from vs_vllm_serve import CASES, WARM_UP, Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ADAPTERS = 4
MAX_RANK = 16
TRAFFIC = ("base", "mixed")
METRIC = "output_throughput"
KEYS = (METRIC, "request_throughput", "median_ttft_ms", "median_itl_ms")
GOALS = {"ours_mixed_over_base": 0.7, "ours_over_vllm_mixed": 1.0}
PROBE_PROMPT = "The quick brown fox"


class LoraServer(Server):
    """``Server`` whose runs take a 5th shape field: the adapter names to spread requests
    over (empty: base model only)."""

    def client_command(self, shape: tuple, seed: int) -> list[str]:
        *plain, names = shape
        cmd = super().client_command(tuple(plain), seed)
        if names:
            cmd += ["--lora-modules", *names, "--lora-assignment", "round-robin"]
        return cmd


def lora_flags(engine: str, adapters: dict[str, str], max_rank: int = MAX_RANK) -> list[str]:
    """The LoRA serve flags of ``engine`` (ours repeats ``--lora-modules``; vLLM's takes a list)."""
    flags = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(max_rank)]
    items = [f"{name}={path}" for name, path in adapters.items()]
    if engine == "vllm":
        return flags + ["--lora-modules", *items]
    for item in items:
        flags += ["--lora-modules", item]
    return flags


def make_plan(rounds: int, quick: bool, names: list[str]) -> list[tuple[str, tuple, int]]:
    """``(traffic, shape, seed)`` per measured run: both traffics per round, same seed."""
    shape = CASES["random"][1 if quick else 0]
    plan = []
    for r in range(rounds):
        for traffic in TRAFFIC if r % 2 == 0 else TRAFFIC[::-1]:
            plan.append((traffic, (*shape, tuple(names) if traffic == "mixed" else ()), 300 + r))
    return plan


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def listed_models(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        data = json.loads(resp.read())["data"]
    return [{"id": m.get("id"), "parent": m.get("parent")} for m in data]


def probe(url: str, models: list[str]) -> dict[str, str]:
    """Greedy 12-token completion of one prompt per model name (base and each adapter)."""
    out = {}
    for name in models:
        body = {"model": name, "prompt": PROBE_PROMPT, "max_tokens": 12, "temperature": 0}
        try:
            out[name] = post_json(url + "/v1/completions", body)["choices"][0]["text"]
        except OSError as exc:  # an HTTP error names the refusal
            out[name] = f"ERROR: {exc}"
    return out


def run_engine(vllm_python, model, name, flags, env_, tmp, plan, names) -> dict:
    """Start one server alone, check and probe its adapters, warm up both traffics (not
    counted), run ``plan``, stop it."""
    server = LoraServer(vllm_python, model, name, flags, env_, tmp)
    try:
        out = {"server_start_s": server.start_s, "models": listed_models(server.url)}
        out["probe"] = probe(server.url, ["bench", *names])
        server.bench((*WARM_UP, ()), seed=1)
        server.bench((*WARM_UP, tuple(names)), seed=2)
        runs: dict[str, list[dict]] = {t: [] for t in TRAFFIC}
        for traffic, shape, seed in plan:
            runs[traffic].append({**server.bench(shape, seed), "seed": seed})
        out["runs"] = runs
    finally:
        server.stop()
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def probe_check(ours: dict, vllm: dict | None, names: list[str]) -> dict:
    """Per adapter: does its greedy text differ from the base model's (each engine), and is
    it the same text in both engines (bf16: a differing token late is not an error)."""
    out = {}
    for name in names:
        row = {"ours_differs_from_base": ours[name] != ours["bench"]}
        if vllm is not None:
            row["vllm_differs_from_base"] = vllm[name] != vllm["bench"]
            row["same_text_both_engines"] = ours[name] == vllm[name]
        out[name] = row
    return out


def server_cpu(result: dict) -> dict[str, float]:
    """Median over rounds of the server's CPU seconds per run (all its processes), per
    traffic: the work a run took, less moved by other load than its wall time."""
    return {
        t: median([sum(r["server_cpu_s"].values()) for r in result["runs"][t]]) for t in TRAFFIC
    }


def aggregate(ours: dict, vllm: dict[str, dict], names: list[str]) -> dict:
    """Medians per engine and traffic, vLLM's best variant per traffic, and the ratios.

    ``ours``: one ``run_engine`` result; ``vllm``: variant -> ``run_engine`` result (those
    that failed to start carry ``error`` and no ``runs``)."""
    med = {t: summarize(ours["runs"][t])["median"] for t in TRAFFIC}
    per_round = [
        _ratio(m[METRIC], b[METRIC])
        for m, b in zip(ours["runs"]["mixed"], ours["runs"]["base"], strict=True)
    ]
    cpu = server_cpu(ours)
    out = {
        "epdserve": {"median": med, "mixed_over_base_per_round": per_round, "server_cpu_s": cpu},
        "ratios": {
            "ours_mixed_over_base": _ratio(med["mixed"][METRIC], med["base"][METRIC]),
            "ours_server_cpu_base_over_mixed": _ratio(cpu["base"], cpu["mixed"]),
        },
    }
    ran = {v: r for v, r in vllm.items() if "runs" in r}
    if ran:
        theirs = {}
        for t in TRAFFIC:
            best = best_variant({v: r["runs"][t] for v, r in ran.items()}, METRIC)
            theirs[t] = {"variant": best, "median": summarize(ran[best]["runs"][t])["median"],
                         "server_cpu_s": server_cpu(ran[best])[t]}  # fmt: skip
        theirs["variants"] = {
            v: {t: summarize(r["runs"][t])["median"] for t in TRAFFIC} for v, r in ran.items()
        }
        out["vllm"] = theirs
        vm, vb = theirs["mixed"]["median"], theirs["base"]["median"]
        out["ratios"] |= {
            "vllm_mixed_over_base": _ratio(vm[METRIC], vb[METRIC]),
            "ours_over_vllm_mixed": _ratio(med["mixed"][METRIC], vm[METRIC]),
            "ours_over_vllm_base": _ratio(med["base"][METRIC], vb[METRIC]),
            "ttft_p50_ours_over_vllm_mixed": _ratio(
                med["mixed"]["median_ttft_ms"], vm["median_ttft_ms"]
            ),
        }
        best_probe = ran[theirs["mixed"]["variant"]].get("probe")
        out["probe_check"] = probe_check(ours["probe"], best_probe, names)
    else:
        out["probe_check"] = probe_check(ours["probe"], None, names)
    out["goals"] = {
        k: {"goal": g, "value": out["ratios"].get(k), "met": (out["ratios"].get(k) or 0) >= g}
        for k, g in GOALS.items()
    }
    return out


def write_adapters(model: Path, count: int) -> dict[str, str]:
    """``make-model --lora``'s adapters of ``model``: name -> path."""
    from epdserve.engine.lora.random_adapters import adapter_name, write_random_adapters

    paths = write_random_adapters(model, count, seed=0)
    return {adapter_name(i): str(p) for i, p in enumerate(paths)}


def adapter_ranks(adapters: dict[str, str]) -> dict[str, int]:
    return {
        n: json.loads((Path(p) / "adapter_config.json").read_text())["r"]
        for n, p in adapters.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 round, 16 prompts x 128/32 tokens")
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get(
        "EPDSERVE_VLLM_VENV", env.DEFAULT_VENV)))  # fmt: skip
    ap.add_argument("--no-install", action="store_true", help="never install vLLM")
    ap.add_argument("--setting", default="defaults", choices=sets.SETTINGS)
    ap.add_argument("--vllm-first", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    cpus = sorted(os.sched_getaffinity(0))
    versions, why = env.ensure_vllm(args.vllm_venv, install=not args.no_install)
    result = {
        "versions": env.versions(versions),
        "cpus": cpus,
        "setting": args.setting,
        "rounds": args.rounds,
        "workload": dict(
            zip(
                ("prompts", "input", "output", "prefix"),
                CASES["random"][1 if args.quick else 0],
                strict=True,
            )
        ),  # fmt: skip
        "order": "vllm first" if args.vllm_first else "epdserve first",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_1_5_15": {"before": os.getloadavg()},
    }
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model = env.make_checkpoint(Path(tmp) / "tiny-llama-bf16", "tiny")
        adapters = write_adapters(model, ADAPTERS)
        names = list(adapters)
        result["model"] = "make-model llama tiny seed 0, bf16 safetensors"
        result["adapters"] = {"ranks": adapter_ranks(adapters), "writer": "make-model --lora"}
        plan = make_plan(args.rounds, args.quick, names)
        vllm_python = str(env.venv_python(args.vllm_venv)) if versions else sys.executable
        engines = ["epdserve"] + (["vllm"] if versions else [])
        runs: dict[str, dict] = {"epdserve": {}, "vllm": {}}
        for name in engines if not args.vllm_first else engines[::-1]:
            flags = sets.serve_flags(args.setting, name) + lora_flags(name, adapters)
            result.setdefault("flags", {})[name] = flags
            for variant, extra in sets.variants(name, None, cpus).items():
                env_ = {**sets.base_env(), **extra}
                try:
                    runs[name][variant] = run_engine(
                        vllm_python, model, name, flags, env_, tmp, plan, names
                    )
                except RuntimeError as exc:
                    if name == "epdserve":
                        raise
                    runs[name][variant] = {"error": str(exc)[-3000:]}
    if not versions:
        result["vllm_skipped"] = f"vLLM unavailable: {why}"
    result["summary"] = aggregate(runs["epdserve"]["default"], runs["vllm"], names)
    result["runs"] = runs
    result["wall_s"] = round(time.time() - started, 1)
    result["loadavg_1_5_15"]["after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
