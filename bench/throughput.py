"""Offline engine throughput, side by side in one run (prints one JSON object).

(a) epdserve ``LLM.generate`` vs transformers batched ``generate`` on the same checkpoint and a
    mixed workload (64 requests; prompt 16–512 and output 16–256 tokens drawn from a seed);
(b) ``small`` preset decode forward: achieved FLOP/s vs a plain matmul chain of the same shapes
    and dtype timed in the same run (this machine's roofline);
(c) ``tiny`` preset, 64 running sequences: share of ``EngineCore.step`` time outside the model
    forward (and, next to it, of the whole ``generate`` with the frontend's detokenization).

    python bench/throughput.py [--dtype bfloat16] [--requests 64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

from epdserve.kernels.linear import linear

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workload(n: int, seed: int, max_prompt: int, max_out: int):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p, o = rng.randint(16, max_prompt), rng.randint(16, max_out)
        reqs.append(([rng.randrange(10, 4000) for _ in range(p)], o))
    return reqs


def run_epdserve(model_dir: str, reqs, dtype: str) -> dict:
    from epdserve.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=1024)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:4], params[:4])  # warm-up
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": tokens, "output_tok_per_s": tokens / dt}


def run_transformers(model_dir: str, reqs, dtype: str, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][0]))
    t = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            group = [reqs[i] for i in order[start : start + batch]]
            width = max(len(p) for p, _ in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(group):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=0,
                max_new_tokens=max(o for _, o in group),
            )
    dt = time.perf_counter() - t
    tokens = sum(o for _, o in reqs)  # only the tokens each request asked for count
    return {
        "seconds": dt,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / dt,
        "batch_size": batch,
    }


def decode_roofline(model_dir: str, dtype: str, batch: int, ctx: int, iters: int) -> dict:
    """Decode forward FLOP/s vs the same matmuls alone (the same linear() chain)."""
    from epdserve.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=ctx + iters + 8, max_num_seqs=batch)
    engine, model = llm.engine, llm.engine.executor.worker.model
    prompts = [
        {"prompt_token_ids": [10 + (i * 31 + j) % 3000 for j in range(ctx)]} for i in range(batch)
    ]
    from epdserve.engine.core.engine_core import EngineCoreRequest

    for i, p in enumerate(prompts):
        engine.add_request(
            EngineCoreRequest(
                f"r{i}",
                p["prompt_token_ids"],
                SamplingParams(temperature=0, max_tokens=iters + 2, ignore_eos=True),
            )
        )
    engine.step()  # prefill everything (budget permitting)
    # every prompt admitted and prefilled: the timed steps are pure decode
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    fwd = [0.0]
    orig = model.forward

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = orig(*a, **k)
        fwd[0] += time.perf_counter() - t0
        return out

    model.forward = timed
    for _ in range(iters):
        engine.step()
    model.forward = orig
    per_step = fwd[0] / iters
    cfg = model.config
    linear_params = cfg.num_layers * (
        cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size)
        + cfg.q_size * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    attn_flops = 4 * batch * (ctx + iters / 2) * cfg.num_heads * cfg.head_dim * cfg.num_layers
    flops = 2 * batch * linear_params + attn_flops
    # the roofline: the same weight matmuls, nothing else
    x = torch.randn(batch, cfg.hidden_size, dtype=model.dtype)
    layers = model.layers

    def matmuls():
        for layer in layers:
            linear(x, layer.qkv_w)
            linear(x, layer.o_w)
            gu = linear(x, layer.gate_up_w)
            linear(gu[:, : cfg.intermediate_size], layer.down_w)

    matmuls()
    t = time.perf_counter()
    for _ in range(iters):
        matmuls()
    mm = (time.perf_counter() - t) / iters
    mm_flops = 2 * batch * linear_params
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "batch": batch,
        "context": ctx,
        "forward_ms": per_step * 1e3,
        "forward_gflops": flops / per_step / 1e9,
        "matmul_ms": mm * 1e3,
        "matmul_gflops": mm_flops / mm / 1e9,
        "fraction_of_matmul_roofline": (flops / per_step) / (mm_flops / mm),
    }


def step_overhead(model_dir: str, dtype: str, batch: int, steps: int) -> dict:
    """Share of engine-step time spent outside the model forward (+ logits).

    Step time is ``EngineCore.step`` (schedule, input preparation, forward, sampling, the
    scheduler's output handling). The offline frontend's per-token detokenization between
    steps is not step time (served, it runs in the API process); ``frontend_s`` and
    ``outside_model_fraction_of_generate`` report it too.
    """
    from epdserve.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=512, max_num_seqs=batch)
    model, core = llm.engine.executor.worker.model, llm.engine
    spent = {"model": 0.0, "step": 0.0}

    def wrap(fn, key):
        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[key] += time.perf_counter() - t0
            return out

        return timed

    prompts = [
        {"prompt_token_ids": [10 + (i * 17 + j) % 3000 for j in range(32)]} for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.engine.kv.reset_prefix_cache()
    model.forward = wrap(model.forward, "model")
    model.compute_logits = wrap(model.compute_logits, "model")
    core.step = wrap(core.step, "step")
    t = time.perf_counter()
    llm.generate(prompts, params)
    total = time.perf_counter() - t
    return {
        "batch": batch,
        "steps": steps,
        "total_s": total,
        "step_s": spent["step"],
        "model_s": spent["model"],
        "frontend_s": total - spent["step"],
        "outside_model_fraction": (spent["step"] - spent["model"]) / spent["step"],
        "outside_model_fraction_of_generate": (total - spent["model"]) / total,
        "output_tok_per_s": batch * steps / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    args = ap.parse_args()
    from epdserve.engine.make_model import make_model

    max_prompt, max_out = (128, 32) if args.quick else (512, 256)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(make_model("llama", f"{tmp}/tiny", seed=0, preset="tiny"))
        small = str(make_model("llama", f"{tmp}/small", seed=0, preset="small"))
        reqs = workload(args.requests, 1234, max_prompt, max_out)
        ours = run_epdserve(tiny, reqs, args.dtype)
        theirs = run_transformers(tiny, reqs, args.dtype, args.hf_batch)
        result = {
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "a_mixed_workload": {
                "requests": len(reqs),
                "epdserve": ours,
                "transformers": theirs,
                "speedup": ours["output_tok_per_s"] / theirs["output_tok_per_s"],
            },
            "b_small_decode_roofline": decode_roofline(
                small, args.dtype, 32, 256, 4 if args.quick else 16
            ),
            "c_tiny_step_overhead": step_overhead(tiny, args.dtype, 64, 16 if args.quick else 64),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
