"""Offline worker for ``bench/vs_vllm.py``: one engine, loaded once, runs rounds on command.

Runs under either venv (ours or vLLM's), so it imports nothing of epdserve at module level.
Reads one JSON command per line on stdin (``{"seed": S, "prompts": N, "prompt_len": P,
"output_len": O}``) and answers each with one ``@@RESULT {json}`` line on stdout (the engines
log to stdout too). The workload is built from the seed with the stdlib, so both engines get
the same token ids in the same round.

    python bench/vs_vllm_offline.py --engine {epdserve,vllm} --model DIR [--kwargs JSON]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

MARK = "@@RESULT "


def token_prompts(seed: int, n: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(n)]


class Engine:
    """The few calls the bench needs, the same for both engines."""

    def __init__(self, kind: str, model: str, kwargs: dict):
        self.kind = kind
        if kind == "vllm":
            from vllm import LLM, SamplingParams
        else:
            from epdserve.engine import LLM, SamplingParams
        self.llm = LLM(model=model, **kwargs)
        self.params = SamplingParams

    def generate(self, prompts: list[list[int]], output_len: int) -> int:
        sp = self.params(temperature=0, max_tokens=output_len, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        kw = {"use_tqdm": False} if self.kind == "vllm" else {}
        outs = self.llm.generate(inputs, sp, **kw)
        return sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("epdserve", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--kwargs", default="{}", help="LLM(...) keyword arguments as JSON")
    args = ap.parse_args()
    engine = Engine(args.engine, args.model, json.loads(args.kwargs))
    engine.generate(token_prompts(-1, 4, 16), 8)  # first-call costs out of the rounds
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        prompts = token_prompts(cmd["seed"], cmd["prompts"], cmd["prompt_len"])
        t = time.perf_counter()
        tokens = engine.generate(prompts, cmd["output_len"])
        dt = time.perf_counter() - t
        result = {"seconds": dt, "output_tokens": tokens, "output_tok_per_s": tokens / dt}
        print(MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
