"""Greedy runs of one checkpoint under each scheduling regime, for one attention backend.

``python attention_backend_runs.py MODEL_DIR BACKEND [--full]`` prints a JSON object
``{regime: {"tokens": [[...], ...], "logprobs": [[...], ...], "preemptions": n, ...}}``. It runs in its own
process so that ``TRITON_INTERPRET=1`` is set before anything imports triton.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# EPDSERVE_TEST_DEVICE=cuda (bench/gpu_check.sh) runs both backends on the GPU instead
DEVICE = os.environ.get("EPDSERVE_TEST_DEVICE", "cpu")
if sys.argv[2:3] == ["triton"] and DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from epdserve.engine import LLM, SamplingParams  # noqa: E402

BLOCK = 16


def prompts(full: bool) -> list[list[int]]:
    """Different lengths, so short prompts decode while long ones still prefill; the longest
    plus its output passes Gemma3's 32-token sliding window (and two blocks)."""
    g = torch.Generator().manual_seed(7)
    lengths = [47, 5, 12, 40, 9, 2] if full else [47, 5, 12]
    return [torch.randint(10, 4000, (n,), generator=g).tolist() for n in lengths]


def block_bytes(llm) -> int:
    cfg = llm.engine.executor.worker.model.config
    return llm.engine.kv_spec.slots * 2 * BLOCK * cfg.num_kv_heads * cfg.head_dim * 4


def regimes(full: bool) -> dict[str, dict]:
    return {
        # 8-token steps: long prompts prefill in chunks next to others' decodes (mixed batches)
        "chunked-mixed": {"max_num_batched_tokens": 8},
        # every prompt twice: the second pass prefills after prefix-cache hits
        "prefix-hits": {"enable_prefix_caching": True},
        # too few blocks for all at once: requests are preempted and recomputed
        # (decodes cross block boundaries: 47 -> 55 and 12 -> 20 tokens)
        "preemption": {"kv_blocks": 5 if not full else 9},
    }


def run(model: str, backend: str, full: bool) -> dict:
    max_tokens = 12 if full else 8
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    batch = [{"prompt_token_ids": p} for p in prompts(full)]
    results = {}
    for name, kw in regimes(full).items():
        kw = dict(kw)
        blocks = kw.pop("kv_blocks", None)
        common = dict(dtype="float32", block_size=BLOCK, max_model_len=64, seed=0, device=DEVICE)
        if DEVICE != "cpu":  # not a share of the whole GPU: the runs need a few blocks
            common["kv_cache_memory"] = 64 << 20
        llm = LLM(model=model, attention_backend=backend, **common, **kw)
        if blocks is not None:  # rebuild with a cache of ``blocks`` blocks per group
            common["kv_cache_memory"] = (
                (blocks + 1) * len(llm.engine.kv_spec.groups) * block_bytes(llm)
            )
            llm = None
            release()
            llm = LLM(model=model, attention_backend=backend, **common, **kw)
        assert llm.engine.executor.worker.model.kernels.name == backend
        outs = llm.generate(batch, greedy)
        if name == "prefix-hits":
            outs += llm.generate(batch, greedy)
        short = [i for i, o in enumerate(outs) if len(o.outputs[0].token_ids) != max_tokens]
        if short:  # a failed request yields no tokens: say so, not "the backends differ"
            raise SystemExit(f"{backend} {name}: requests {short} did not finish (see the log)")
        results[name] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            # the chosen tokens' logprobs: random tiny models repeat tokens, so these carry
            # the finer signal (a dropped sliding window moves them by ~0.4)
            "logprobs": [
                [
                    lp[t].logprob
                    for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
                ]
                for o in outs
            ],  # fmt: skip
            "cached": [o.num_cached_tokens for o in outs],
            "preemptions": llm.engine.scheduler.num_preemptions,
            "free_ok": llm.engine.kv.num_free_blocks() == llm.engine.num_blocks - 1,
        }
        llm = None
        release()
    return results


def release() -> None:
    """Free the engine just dropped before the next one is built: on a GPU its KV cache
    would still be held."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2], "--full" in sys.argv[3:])))
