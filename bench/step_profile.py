"""Where an engine step's time goes, by sampling (py-spy), for one offline workload.

The workload is the served side by side's case (c): a 512-token prefix already cached, then
64 prompts of that prefix plus 128 new tokens each, 128 tokens out (tiny llama, bf16). The
child process runs ``LLM.generate``; py-spy samples it; each sample is put in the first
category (in the order of ``CATEGORIES``) that one of its frames is in. ``--prefill sdpa`` runs prefill over a
cached prefix as before the C prefill kernel (per sequence, torch SDPA).

    .venv/bin/python bench/step_profile.py [--prefill kernel|sdpa] [--block-size 128]

Needs ``py-spy`` (``pip install py-spy``); prints JSON. Shares are of sampled CPU time in
the engine process; ``ms_per_step`` = share x seconds / steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter

# (category, frame-name fragments): the innermost frame that matches decides
CATEGORIES = [
    ("attention: prefill (spans over the cached prefix)", ("_prefill_native", "_prefill_one")),
    ("attention: decode", ("_decode_native", "paged_decode")),
    ("KV cache write", ("reshape_and_cache",)),
    ("rotary + norms", ("rotary_embedding", "rms_norm")),
    ("MLP", ("_mlp",)),
    ("attention projections", ("_attention",)),
    ("logits + sampling", ("compute_logits", "sample", "Sampler")),
    ("scheduler + KV manager", ("schedule", "allocate_slots", "kv_cache_manager", "block_pool")),
    ("batch inputs", ("input_batch", "device_inputs", "prepare_inputs", "_prepare")),
    ("outputs + detokenize", ("output_processor", "detokenizer", "process")),
]

CHILD = """
import json, random, sys, time
from epdserve.engine import LLM, SamplingParams
from epdserve.kernels import native
spec = json.loads(sys.argv[1])
if spec["prefill"] == "sdpa":
    native.prefill_supports = lambda *a: False
llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=2048,
          block_size=spec["block_size"])
rng = random.Random(7)
shared = [rng.randrange(10, 4000) for _ in range(512)]
prompts = [shared + [rng.randrange(10, 4000) for _ in range(128)] for _ in range(64)]
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate([{"prompt_token_ids": shared + [5]}], SamplingParams(max_tokens=2))
steps = [0]
real_step = llm.engine.step
def counted():
    steps[0] += 1
    return real_step()
llm.engine.step = counted
sys.stdout.write("go\\n"); sys.stdout.flush(); sys.stdin.readline()
t = time.perf_counter()
llm.generate([{"prompt_token_ids": p} for p in prompts], params)
print(json.dumps({"seconds": time.perf_counter() - t, "steps": steps[0]}), flush=True)
"""


def categorize(raw_lines) -> Counter:
    counts: Counter = Counter()
    for line in raw_lines:
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        label = "other Python / torch"
        names = [frame.split(" (")[0] for frame in frames]
        for category, keys in CATEGORIES:  # the first category any frame is in
            if any(k in name for name in names for k in keys):
                label = category
                break
        counts[label] += int(n)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", choices=("kernel", "sdpa"), default="kernel")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--model", help="model dir (default: a fresh tiny llama)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from epdserve.engine.make_model import make_model

            model = str(make_model("llama", f"{tmp}/tiny", seed=0))
        spec = json.dumps({"model": model, "prefill": args.prefill, "block_size": args.block_size})
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert child.stdout.readline().strip() == "go"
        raw = f"{tmp}/samples.txt"
        spy = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--pid",
             str(child.pid), "--rate", "250", "--format", "raw", "-o", raw],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        child.stdin.write("\n")
        child.stdin.flush()
        result = json.loads(child.stdout.readline())
        child.wait(60)
        spy.wait(60)
        with open(raw) as f:
            counts = categorize(f)
    total = sum(counts.values()) or 1
    per_step = result["seconds"] * 1e3 / max(1, result["steps"])
    print(
        json.dumps(
            {
                "prefill": args.prefill,
                "block_size": args.block_size,
                **result,
                "ms_per_step": round(per_step, 2),
                "categories": {
                    k: {"share": round(v / total, 3), "ms_per_step": round(v / total * per_step, 2)}
                    for k, v in counts.most_common()
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
