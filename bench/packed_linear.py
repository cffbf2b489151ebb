"""Prepacked bf16 weights (``kernels/linear.py``) against plain ``F.linear``, with and without.

Two parts, one JSON object:

- ``matmuls``: each distinct weight shape of a preset's layer (q|k|v, o, gate|up, down, and
  the LM head), at several row counts (1-64: decode batches; 2,048: a prefill step), best of
  ``--repeats`` timings of ``--calls`` calls each, plain and packed interleaved; the products
  are compared too (``bit_equal``: whether the packed result equals ``F.linear``'s here).
- ``offline`` (with ``--model``): ``LLM.generate`` of the offline side by side's workload
  (64 prompts x 128 in / 64 out, greedy) in a fresh process per run, with packing on and
  off (``EPDSERVE_PACKED_LINEAR=0``), alternating over ``--rounds``.

    .venv/bin/python bench/packed_linear.py --preset qwen2.5-0.5b [--model DIR] [--rounds 2]

The ``cpu`` block names the CPU and its ``amx_bf16`` / ``avx512_bf16`` flags: oneDNN picks
its kernels by them, so the ratio measured on one does not carry over to the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_vllm_env import cpu_info  # noqa: E402

from epdserve.engine.serving_shapes import SHAPES, VOCAB  # noqa: E402
from epdserve.kernels.linear import linear, pack  # noqa: E402

ROWS = (1, 16, 64, 256, 2048)
CHILD = """
import json, os, random, sys, time
from epdserve.engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16")
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(10, 4000) for _ in range(128)]} for _ in range(64)]
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
t = time.perf_counter()
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
print(json.dumps({"output_tok_per_s": 64 * 64 / (time.perf_counter() - t)}))
"""


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    hidden, _, heads, kv_heads, head_dim, inter = SHAPES[preset]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (VOCAB, hidden),
    }


def best_ms(fn, calls: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return min(times) * 1e3


def matmuls(preset: str, calls: int, repeats: int) -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes(preset).items():
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        packed = pack(w)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g).bfloat16()
            n_calls = max(1, calls * 64 // rows)
            plain_ms = best_ms(lambda: F.linear(x, w), n_calls, repeats)  # noqa: B023
            packed_ms = best_ms(lambda: linear(x, packed), n_calls, repeats)  # noqa: B023
            flops = 2 * rows * n * k
            out.append(
                {
                    "weight": name,
                    "shape": [n, k],
                    "rows": rows,
                    "plain_ms": round(plain_ms, 4),
                    "packed_ms": round(packed_ms, 4),
                    "speedup": round(plain_ms / packed_ms, 2),
                    "packed_gflops": round(flops / packed_ms / 1e6, 1),
                    "bit_equal": bool(torch.equal(F.linear(x, w), linear(x, packed))),
                }
            )
    return out


def offline(model: str, rounds: int) -> dict:
    runs: dict[str, list[float]] = {"packed": [], "plain": []}
    for r in range(rounds):
        order = ("packed", "plain") if r % 2 == 0 else ("plain", "packed")
        for mode in order:
            env = {**os.environ, "EPDSERVE_PACKED_LINEAR": "1" if mode == "packed" else "0"}
            res = subprocess.run(
                [sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True
            )
            if res.returncode:
                raise SystemExit(res.stderr[-2000:])
            runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1])["output_tok_per_s"])
    med = {m: statistics.median(v) for m, v in runs.items()}
    return {
        "workload": "64 prompts x 128 in / 64 out, greedy, bf16",
        "output_tok_per_s": runs,
        "median": med,
        "packed_over_plain": round(med["packed"] / med["plain"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--model", help="a make-model checkpoint: also time LLM.generate")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    result = {
        "preset": args.preset,
        "threads": torch.get_num_threads(),
        "cpu": cpu_info(),
        "matmuls": matmuls(args.preset, args.calls, args.repeats),
    }
    if args.model:
        result["offline"] = offline(args.model, args.rounds)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
