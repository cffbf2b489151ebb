"""``--kv-cache-dtype fp8`` against the model's dtype on this CPU: decode throughput of one
bf16 model with its KV cache stored as bf16 (the native C attention kernels reading it in
place) and as fp8 (the batch's blocks gathered and read back up to bf16 by the C pass of
``csrc/fp8_kv.c`` or by torch's cast, then the native C kernels or the torch twin), and the
KV bytes per block.

One JSON object: per variant, ``decode_tok_per_s`` (the extra tokens over the extra time
between ``--max-tokens`` and 1 output token, each the best of ``--rounds``, the variants
interleaved in each round so they share the machine's load) and ``kv_bytes_per_block``; ``ratios``: each
variant's decode throughput over bf16's.

    .venv/bin/python bench/kv_cache_dtype.py [--preset small] [--prompts 8] [--context 512]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_vllm_env import cpu_info  # noqa: E402

from epdserve.engine import LLM, SamplingParams  # noqa: E402
from epdserve.engine.make_model import make_model  # noqa: E402
from epdserve.kernels import fp8_kv  # noqa: E402

VARIANTS = {  # name -> (kv_cache_dtype, attention_backend, read back in C)
    "bf16-native": ("auto", "native", True),
    "fp8-native": ("fp8", "native", True),
    "fp8-native-torch-cast": ("fp8", "native", False),
    "fp8-torch": ("fp8", "torch", True),
}


@contextlib.contextmanager
def read_back_in_c(on: bool):
    real = fp8_kv.native.fp8_blocks_supports
    if not on:
        fp8_kv.native.fp8_blocks_supports = lambda *args: False
    try:
        yield
    finally:
        fp8_kv.native.fp8_blocks_supports = real


def timed(llm: LLM, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = make_model("llama", tempfile.mkdtemp(prefix="kvdtype-"), 0, args.preset)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(args.context)] for _ in range(args.prompts)]
    engines = {
        name: LLM(
            model=str(path),
            dtype="bfloat16",
            max_model_len=args.context + 64,
            kv_cache_dtype=kv,
            attention_backend=backend,
            kv_cache_memory=256 << 20,
            enable_prefix_caching=False,
        )  # fmt: skip
        for name, (kv, backend, _) in VARIANTS.items()
    }
    best = {(name, n): float("inf") for name in VARIANTS for n in (1, args.max_tokens)}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            with read_back_in_c(VARIANTS[name][2]):
                for n in (1, args.max_tokens):
                    best[name, n] = min(best[name, n], timed(llm, prompts, n))
    tokens = args.prompts * (args.max_tokens - 1)
    out = {"cpu": cpu_info(), "preset": args.preset, "prompts": args.prompts,
           "context": args.context, "max_tokens": args.max_tokens, "variants": {}}  # fmt: skip
    for name, llm in engines.items():
        cache = llm.engine.executor.worker.runner.kv_cache
        out["variants"][name] = {
            # the prompts' steps (no prefix cache) are in both timings: the rest is decode
            "decode_tok_per_s": round(tokens / (best[name, args.max_tokens] - best[name, 1]), 1),
            "kv_bytes_per_block": cache.nbytes // cache.shape[0],
        }
    base = out["variants"]["bf16-native"]["decode_tok_per_s"]
    out["ratios"] = {n: round(v["decode_tok_per_s"] / base, 3) for n, v in out["variants"].items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
