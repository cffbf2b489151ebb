"""Decode-attention bandwidth of the CPU twin vs a plain ``copy_`` of the same bytes.

Prints one JSON object. For each config a cross-layer KV cache is built, 64 sequences of
``ctx`` tokens (256, 1024, or "ragged": 16..1024) decode one token each through the
CPU kernel backends' ``paged_attention``, and the KV bytes it must read are timed
against ``dst.copy_(src)`` of that many bytes in the same run (interleaved, best of N).
Two backends, side by side: ``native`` (the C kernel, what the engine runs when a C
compiler is present) and ``torch`` (the batched torch decode it falls back to).
``ratio`` = native bytes/s / copy bytes/s (target >= 0.30), ``torch_ratio`` the same for
the torch path; ``gather_ms`` is the torch path's block gather alone, every sequence padded
to the longest.

``prefill``: query spans of the tiny model (4 heads, 2 kv heads, head_dim 32, bf16, block
32) through the per-sequence SDPA path (``torch`` backend: gather + SDPA per span, the
path the native backend took before) vs the C prefill kernel in one call
(``native.paged_prefill``) and vs the native backend (what the engine runs: plain prompts
stay on SDPA); medians of interleaved runs.

    .venv/bin/python bench/attention_kernels.py [--quick] [--threads N] [--prefill-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from epdserve.kernels import native
from epdserve.kernels.backends import NativeBackend, TorchBackend
from epdserve.kernels.gather import block_ids, gather_blocks

CONFIGS = [  # (name, heads, kv_heads, head_dim): make-model's presets, then a real-size one
    ("tiny", 4, 2, 32),
    ("small", 12, 4, 64),
    ("llama-8b-like", 32, 8, 128),
]


def times_of_interleaved(fns, repeats: int) -> list[list[float]]:
    """Times of each function, alternating them so all see the same machine load."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


def best_of_interleaved(fns, repeats: int) -> list[float]:
    return [min(t) for t in times_of_interleaved(fns, repeats)]


def context_lengths(ctx, seqs: int) -> torch.Tensor:
    """``ctx`` tokens each, or for ``"ragged"`` lengths spread over 16..1024 (fixed seed)."""
    if ctx == "ragged":
        return torch.randint(16, 1025, (seqs,), generator=torch.Generator().manual_seed(0))
    return torch.full((seqs,), ctx)


def decode_case(heads, kv_heads, head_dim, ctx, seqs, block_size, dtype, repeats):
    lens = context_lengths(ctx, seqs)
    nblk = -(-int(lens.max()) // block_size)
    num_blocks = seqs * nblk + 1
    kv = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, dtype=dtype)
    key_cache, value_cache = kv[:, 1, 0], kv[:, 1, 1]
    table = (torch.randperm(num_blocks - 1)[: seqs * nblk] + 1).view(seqs, nblk).int()
    seq_lens = lens.int()
    qsl = torch.arange(seqs + 1, dtype=torch.int32)
    query = torch.randn(seqs, heads, head_dim, dtype=dtype)
    args = (query, key_cache, value_cache, table, seq_lens, qsl, head_dim**-0.5)
    kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * kv.element_size()
    src = torch.randn(kv_bytes // kv.element_size(), dtype=dtype)
    dst = torch.empty_like(src)
    ids = block_ids(table, None, nblk)

    def gather():
        gather_blocks(key_cache, ids, "k")
        gather_blocks(value_cache, ids, "v")

    native_backend, torch_backend = NativeBackend(), TorchBackend()
    fns = [
        lambda: native_backend.paged_attention(*args),  # the twin if the C kernel is absent
        lambda: torch_backend.paged_attention(*args),
        lambda: dst.copy_(src),
        gather,
    ]
    t_native, t_torch, t_copy, t_gather = best_of_interleaved(fns, repeats)
    return {
        "kv_bytes": kv_bytes,
        "native_ms": round(t_native * 1e3, 3),
        "torch_ms": round(t_torch * 1e3, 3),
        "copy_ms": round(t_copy * 1e3, 3),
        "gather_ms": round(t_gather * 1e3, 3),
        "native_GBps": round(kv_bytes / t_native / 1e9, 2),
        "copy_GBps": round(kv_bytes / t_copy / 1e9, 2),
        "ratio": round(t_copy / t_native, 3),
        "torch_ratio": round(t_copy / t_torch, 3),
    }


PREFILL_CASES = [  # (name, sequences, new tokens each, context each)
    ("served-prefix", 16, 128, 640),  # 512 cached prefix tokens + 128 new
    ("chunk-over-1536", 2, 512, 2048),
    ("plain-16x128", 16, 128, 128),
    ("plain-4x512", 4, 512, 512),
    ("plain-1x2048", 1, 2048, 2048),
]


def median_of_interleaved(fns, repeats: int) -> list[float]:
    return [statistics.median(t) for t in times_of_interleaved(fns, repeats)]


def prefill_case(seqs, q_len, ctx, repeats, heads=4, kv_heads=2, head_dim=32, block_size=32):
    nblk = -(-ctx // block_size)
    num_blocks = seqs * nblk + 1
    kv = torch.randn(num_blocks, 4, 2, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    key_cache, value_cache = kv[:, 1, 0], kv[:, 1, 1]
    table = (torch.randperm(num_blocks - 1)[: seqs * nblk] + 1).view(seqs, nblk).int()
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, dtype=torch.int32) * q_len
    query = torch.randn(seqs * q_len, heads, head_dim, dtype=torch.bfloat16)
    args = (query, key_cache, value_cache, table, lens, qsl, head_dim**-0.5)
    spans = (list(range(seqs)), qsl[:-1].tolist(), [q_len] * seqs, lens.tolist())
    fns = [
        lambda: TorchBackend().paged_attention(*args),
        lambda: native.paged_prefill(*args[:4], *spans, args[-1], None, None).to(query.dtype),
        lambda: NativeBackend().paged_attention(*args),
    ]
    t_sdpa, t_kernel, t_backend = median_of_interleaved(fns, repeats)
    return {
        "seqs": seqs, "new_tokens": q_len, "context": ctx,
        "sdpa_ms": round(t_sdpa * 1e3, 3), "kernel_ms": round(t_kernel * 1e3, 3),
        "native_backend_ms": round(t_backend * 1e3, 3), "speedup": round(t_sdpa / t_kernel, 2),
    }  # fmt: skip


def prefill_results(repeats: int) -> list[dict]:
    if not native.available():
        return []
    return [{"case": name} | prefill_case(*shape, repeats) for name, *shape in PREFILL_CASES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode cases")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    repeats = 5 if opts.quick else 20
    results = []
    for dtype in (torch.bfloat16, torch.float32) if not opts.prefill_only else ():
        for name, heads, kv_heads, head_dim in CONFIGS:
            for ctx in (256, 1024, "ragged"):
                case = decode_case(heads, kv_heads, head_dim, ctx, opts.seqs,
                                   opts.block_size, dtype, repeats)  # fmt: skip
                head = {"config": name, "heads": heads, "kv_heads": kv_heads,
                        "head_dim": head_dim, "ctx": ctx, "dtype": str(dtype)[6:]}  # fmt: skip
                results.append(head | case)
    print(json.dumps({
        "bench": "kernels.paged_attention_decode",
        "seqs": opts.seqs,
        "block_size": opts.block_size,
        "torch_threads": torch.get_num_threads(),
        "native_kernel": native.available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "twin": results,
        "min_ratio": min((r["ratio"] for r in results), default=None),
        "min_torch_ratio": min((r["torch_ratio"] for r in results), default=None),
        "prefill": prefill_results(max(3, repeats // 2)),
        "gpu": "not measured (no GPU on this machine)",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
