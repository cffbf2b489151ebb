"""Hybrid KV cache vs one group, side by side in one run (prints one JSON object).

Gemma3 (sliding-window layers beside global ones) under the same KV-cache memory: how many
blocks fit, how many sequences run at once, preemptions, output throughput, and whether
the greedy outputs are identical. Long prompts make the difference: a sliding-window group
keeps at most ``cdiv(window - 1 + chunk, block_size) + 1`` blocks per sequence.

    python bench/hybrid_kv.py [--preset tiny] [--requests 32] [--prompt 480] [--output 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(model: str, hybrid: bool, reqs, memory: int) -> dict:
    from epdserve.engine import LLM, SamplingParams
    from epdserve.engine.core.engine_core import EngineCoreRequest

    llm = LLM(
        model=model,
        max_model_len=1024,
        kv_cache_memory=memory,
        max_num_batched_tokens=512,
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    engine = llm.engine
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(EngineCoreRequest("warm", reqs[0][0][:64], warm))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.reset_prefix_cache()
    outputs = {str(i): [] for i in range(len(reqs))}
    for i, (prompt, n) in enumerate(reqs):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(EngineCoreRequest(str(i), prompt, params))
    peak_running = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        peak_running = max(peak_running, engine.scheduler.num_running())
        steps += 1
    seconds = time.perf_counter() - start
    tokens = sum(len(t) for t in outputs.values())
    return {
        "kv_cache_groups": engine.kv.num_groups,
        "num_blocks": engine.num_blocks,
        "peak_running": peak_running,
        "preemptions": engine.scheduler.num_preemptions,
        "steps": steps,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(tokens / seconds, 1),
        "_outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=480)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: 8 seqs)")
    args = ap.parse_args()

    from epdserve.engine.make_model import make_model
    from epdserve.engine.models.config import load_model_config

    rng = random.Random(0)
    reqs = [
        ([rng.randrange(10, 4000) for _ in range(args.prompt)], args.output)
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model("gemma3", f"{tmp}/m", seed=0, preset=args.preset))
        cfg = load_model_config(model)
        per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
        # default: room for 8 whole sequences without the hybrid cache
        memory = args.kv_cache_memory or 8 * (args.prompt + args.output + 16) * per_token
        single = run(model, False, reqs, memory)
        hybrid = run(model, True, reqs, memory)
    same = single.pop("_outputs") == hybrid.pop("_outputs")
    print(
        json.dumps(
            {
                "model": f"gemma3-{args.preset}",
                "layer_types": list(cfg.layer_types),
                "sliding_window": cfg.sliding_window,
                "kv_cache_memory": memory,
                "workload": {
                    "requests": args.requests,
                    "prompt": args.prompt,
                    "output": args.output,
                },
                "one_group": single,
                "hybrid": hybrid,
                "ratios": {
                    "blocks": round(hybrid["num_blocks"] / single["num_blocks"], 2),
                    "peak_running": round(hybrid["peak_running"] / single["peak_running"], 2),
                    "throughput": round(hybrid["output_tok_per_s"] / single["output_tok_per_s"], 2),
                },
                "identical_outputs": same,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
