"""On a CUDA GPU: decode attention's HBM bandwidth (Triton backend) as a share of the device's
peak, and the offline engine's throughput with the Triton backend. Prints one JSON object.

(a) For each layout, 64 sequences of ``ctx`` tokens decode one token each through the
``triton`` backend's ``paged_attention`` on a bf16 cross-layer cache; the KV bytes it must
read divided by its time (CUDA events, median of N) is its bandwidth. It is compared, in
the same run, with a device-to-device ``copy_`` (``copy_share``: bytes read+written per
second) and with the device's nominal peak when its name is known (``peak_share``; goal
>= 0.6). (b) ``LLM.generate`` of 64 prompts x 128 tokens on the small make-model preset,
``device=cuda``, ``attention_backend=triton``, bf16: output tokens per second.

    python bench/gpu_decode.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

LAYOUTS = [("small", 12, 4, 64), ("llama-8b-like", 32, 8, 128)]
NOMINAL_TBPS = {"H200": 4.8, "H100 SXM": 3.35, "H100 PCIe": 2.0, "H100": 3.35, "A100": 2.0}


def nominal_peak(name: str) -> float | None:
    """The datasheet HBM bandwidth (bytes/s) of a known device name, else None."""
    for key, tbps in NOMINAL_TBPS.items():
        if key in name:
            return tbps * 1e12
    return None


def cuda_time(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (CUDA events, after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def decode_case(backend, heads, kv_heads, head_dim, ctx, seqs, repeats, block_size=16) -> dict:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    nblk = -(-ctx // block_size)
    num_blocks = seqs * nblk + 1
    kv = torch.randn(num_blocks, 1, 2, block_size, kv_heads, head_dim, dtype=dtype, device=dev)
    key_cache, value_cache = kv[:, 0, 0], kv[:, 0, 1]
    table = (torch.randperm(num_blocks - 1, device=dev)[: seqs * nblk] + 1).view(seqs, nblk)
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(seqs + 1, dtype=torch.int32, device=dev)
    query = torch.randn(seqs, heads, head_dim, dtype=dtype, device=dev)
    args = (query, key_cache, value_cache, table.int(), seq_lens, qsl, head_dim**-0.5)
    kv_bytes = 2 * seqs * ctx * kv_heads * head_dim * kv.element_size()
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t_attn = cuda_time(lambda: backend.paged_attention(*args), repeats)
    t_copy = cuda_time(lambda: dst.copy_(src), repeats)
    attn_bps, copy_bps = kv_bytes / t_attn, 2 * kv_bytes / t_copy
    peak = nominal_peak(torch.cuda.get_device_name())
    return {
        "ctx": ctx,
        "kv_bytes": kv_bytes,
        "attention_ms": round(t_attn * 1e3, 4),
        "attention_GBps": round(attn_bps / 1e9, 1),
        "copy_GBps": round(copy_bps / 1e9, 1),
        "copy_share": round(attn_bps / copy_bps, 3),
        "peak_share": round(attn_bps / peak, 3) if peak else None,
    }


def offline_throughput(num_prompts: int, max_tokens: int) -> dict:
    from epdserve.engine import LLM, SamplingParams
    from epdserve.engine.make_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_model("llama", f"{tmp}/small", seed=0, preset="small"))
        llm = LLM(model=path, dtype="bfloat16", device="cuda", attention_backend="triton")
        prompts = [{"prompt_token_ids": [10 + (i * 7 + j) % 3000 for j in range(64)]}
                   for i in range(num_prompts)]  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    return {
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(num_prompts * max_tokens / elapsed, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_decode.py needs a CUDA device")
    from epdserve.kernels.backends import get_backend

    backend = get_backend("triton", torch.device("cuda"))
    repeats = 5 if args.quick else 20
    decode = {
        name: [
            decode_case(backend, h, kvh, d, ctx, 64, repeats)
            for ctx in ((1024,) if args.quick else (1024, 4096))
        ]
        for name, h, kvh, d in LAYOUTS
    }
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "a_decode_attention": decode,
        "b_offline_triton": offline_throughput(64, 32 if args.quick else 128),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
