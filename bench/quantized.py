"""Quantized weights against bf16: the same model as bf16, int4 (GPTQ layout) and fp8
(compressed-tensors, per channel), on this CPU.

One JSON object:

- ``models``: per variant, the bytes of the loaded model's weight tensors (``weights_bytes``:
  every tensor the decoder holds, embedding and norms included; ``linear_bytes``: the layers'
  matrix-product weights alone) and offline ``LLM.generate`` throughput, each variant in a
  fresh process: ``--prompts`` prompts of 16 tokens, timed (best of 2) at 1 and
  ``--max-tokens`` output tokens; ``decode_tok_per_s`` is the extra tokens over the extra time
  (decode alone), the median of ``--rounds`` runs with the variants interleaved;
- ``matmuls``: the gate|up product at decode row counts (ms; every layer's in turn, so the
  weights come from memory), the three loaded forms and ``fp8_kept``
  (``EPDSERVE_FP8_CPU_WEIGHTS=fp8``: fp8 in memory, upcast per product), the choice the
  engine does not make by default on a CPU.

The int4 checkpoint is written by ``engine/models/quant/write.py`` (round to nearest in
GPTQ's layout, group 128, symmetric); the bf16 one by ``make-model --preset``.

    .venv/bin/python bench/quantized.py --preset qwen2.5-0.5b [--work DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_vllm_env import cpu_info  # noqa: E402

from epdserve.engine.models.quant.write import write_quantized  # noqa: E402

CHILD = """
import json, random, sys, time
from epdserve.engine import LLM, SamplingParams
path, prompts_n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=path, dtype="bfloat16", max_model_len=256)
model = llm.engine.executor.worker.model
seen, total, linear = set(), 0, 0
def size(w):
    return w.nbytes if hasattr(w, "tensors") else w.numel() * w.element_size()
for layer in model.layers:
    for name in layer.__slots__:
        w = getattr(layer, name)
        if name in ("rope", "window", "index") or w is None or id(w) in seen:
            continue
        seen.add(id(w))
        total += size(w)
        if name in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            linear += size(w)
for w in (model.embed, model.final_norm, model.lm_head):
    if id(w) not in seen:
        seen.add(id(w)); total += size(w)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(10, 4000) for _ in range(16)]}
           for _ in range(prompts_n)]
def timed(n):
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t
timed(2)  # warm up
t1 = min(timed(1) for _ in range(2))
tn = min(timed(max_tokens) for _ in range(2))
print(json.dumps({"weights_bytes": total, "linear_bytes": linear,
                  "decode_tok_per_s": prompts_n * (max_tokens - 1) / (tn - t1),
                  "output_tok_per_s": prompts_n * max_tokens / tn}))
"""


def run_variant(path: Path, prompts: int, max_tokens: int, threads: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(prompts), str(max_tokens)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def matmuls(paths: dict[str, Path], rows=(1, 8)) -> dict:
    """The gate|up product per variant, ms: every layer's in turn (so the weights stream from
    memory as in a step, not from the cache), best of 3 passes."""
    from epdserve.engine.models.loader import load_model
    from epdserve.kernels.linear import linear

    out = {}
    runs = [*paths.items(), ("fp8_kept", paths["fp8"])]
    for name, path in runs:
        os.environ["EPDSERVE_FP8_CPU_WEIGHTS"] = "fp8" if name == "fp8_kept" else "dequantize"
        model = load_model(path, torch.bfloat16, torch.device("cpu"), 64)
        weights = [layer.gate_up_w for layer in model.layers]
        for r in rows:
            x = torch.randn(r, model.config.hidden_size).bfloat16()
            for w in weights:  # oneDNN's first call builds its kernel
                linear(x, w)
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for w in weights:
                    linear(x, w)
                best = min(best, (time.perf_counter() - t) / len(weights))
            out[f"{name}_rows{r}_ms"] = round(best * 1e3, 3)
    return out


def median_run(runs: list[dict]) -> dict:
    """The sizes of the first run, the median throughputs and every run's decode tok/s."""
    out = dict(runs[0])
    for key in ("decode_tok_per_s", "output_tok_per_s"):
        out[key] = round(statistics.median(r[key] for r in runs), 1)
    out["decode_runs"] = [round(r["decode_tok_per_s"], 1) for r in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: temp)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads (1 where other work shares the CPUs: a 2-thread product whose "
        "second thread lost its CPU waits a scheduler slice)",
    )
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="epd-quant-"))
    from epdserve.engine.make_model import make_model

    bf16 = work / f"{args.preset}-bf16"
    if not bf16.exists():
        make_model("qwen2", bf16, seed=0, preset=args.preset)
    paths = {"bf16": bf16, "int4_gptq": work / "int4", "fp8": work / "fp8"}
    if not paths["int4_gptq"].exists():
        write_quantized(bf16, paths["int4_gptq"], "gptq", dtype=torch.bfloat16)
    if not paths["fp8"].exists():
        write_quantized(bf16, paths["fp8"], "compressed-tensors", dtype=torch.bfloat16)
    torch.set_num_threads(args.threads)
    runs: dict[str, list[dict]] = {name: [] for name in paths}
    for _ in range(args.rounds):  # interleaved: a busy machine slows every variant alike
        for name, p in paths.items():
            runs[name].append(run_variant(p, args.prompts, args.max_tokens, args.threads))
    models = {name: median_run(r) for name, r in runs.items()}
    base = models["bf16"]
    for m in models.values():
        m["linear_bytes_vs_bf16"] = round(m["linear_bytes"] / base["linear_bytes"], 3)
        m["weights_bytes_vs_bf16"] = round(m["weights_bytes"] / base["weights_bytes"], 3)
        m["decode_vs_bf16"] = round(m["decode_tok_per_s"] / base["decode_tok_per_s"], 2)
    result = {
        "preset": args.preset,
        "cpu": cpu_info(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "workload": {"prompts": args.prompts, "prompt_tokens": 16, "max_tokens": args.max_tokens},
        "models": models,
        "matmuls": matmuls(paths),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
