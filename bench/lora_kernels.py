"""LoRA delta on CPUs: the torch twin vs the CPU path vs the base projection it rides on.

Prints one JSON object. For each case (layer ``in x out``, rank, dtype, tokens ``T``, and
the batch's slot pattern) three functions run interleaved and their medians are reported
in microseconds:

- ``twin_us``: ``lora_ref.lora_apply_ref`` (a torch chain per adapter present);
- ``cpu_us``: ``lora.lora_apply``, what the engine calls (validation + the C kernel);
- ``cpu_bt_us``: the same with ``b_stack`` a view of ``[S, r, out]`` memory (read in place,
  no per-call transposition of B);
- ``base_us``: ``F.linear(x, W)`` of the same layer without LoRA (W ``[out, in]``).

``overhead`` = ``cpu_us / base_us``: what LoRA adds to that projection; ``speedup`` =
``twin_us / cpu_us``. Patterns: ``none`` (every row -1), ``one`` (every row slot 0),
``4-runs`` (4 adapters, contiguous runs, a few base rows), ``4-mixed`` (the same rows shuffled).

``--gpu`` (bench/gpu_check.sh): the Triton kernel on CUDA against the twin on CUDA, mixed
slots, a column-slice ``y``, float32 and bfloat16; prints the largest differences and the
Triton/``F.linear`` medians, exits 1 when a difference is beyond the tests' tolerances.

``--threads 1`` gives steadier figures on a shared 2-core machine (torch's OpenMP barriers
stall when other processes hold the cores; the C kernel runs one thread below 2**20
multiply-adds anyway).

    .venv/bin/python bench/lora_kernels.py [--quick] [--threads N] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from epdserve.kernels import native
from epdserve.kernels.lora import lora_apply
from epdserve.kernels.lora_ref import lora_apply_ref

LAYERS = [  # (name, in, out, rank): the tiny model's q and MLP up projections, a 2048 one
    ("h64-r8", 64, 64, 8),
    ("h256-r16", 256, 256, 16),
    ("h256-up-r16", 256, 512, 16),
    ("h2048-r16", 2048, 2048, 16),
]
TOKENS = [1, 8, 64, 512]
PATTERNS = ["none", "one", "4-runs", "4-mixed"]


def slot_pattern(name: str, tokens: int) -> torch.Tensor:
    if name == "none":
        return torch.full((tokens,), -1, dtype=torch.int32)
    if name == "one":
        return torch.zeros(tokens, dtype=torch.int32)
    # 0..3 in runs, every 8th row without an adapter
    runs = [-1 if t % 8 == 7 else t * 4 // tokens for t in range(tokens)]
    slots = torch.tensor(runs, dtype=torch.int32)
    if name == "4-mixed":
        slots = slots[torch.randperm(tokens, generator=torch.Generator().manual_seed(0))]
    return slots


def medians_of_interleaved(fns, repeats: int) -> list[float]:
    """Median seconds of each function, alternating them so all see the same load; in a new
    order each round, so none always runs right after the one that pollutes the caches."""
    times, order, rng = [[] for _ in fns], list(range(len(fns))), random.Random(0)
    for fn in fns:
        fn()
    for _ in range(repeats):
        rng.shuffle(order)
        for i in order:
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def run_case(in_dim, out_dim, rank, dtype, tokens, pattern, repeats):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, in_dim, generator=g).to(dtype)
    w = (torch.randn(out_dim, in_dim, generator=g) / in_dim**0.5).to(dtype)
    a = (torch.randn(4, rank, in_dim, generator=g) / in_dim**0.5).to(dtype)
    b = torch.randn(4, out_dim, rank, generator=g).to(dtype)
    scaling = torch.full((4,), 2.0)
    slots = slot_pattern(pattern, tokens)
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)
    y_twin, y_cpu = (
        torch.zeros(tokens, out_dim, dtype=dtype),
        torch.zeros(tokens, out_dim, dtype=dtype),
    )
    fns = [
        lambda: lora_apply_ref(y_twin, x, slots, a, b, scaling),
        lambda: lora_apply(y_cpu, x, slots, a, b, scaling),
        lambda: lora_apply(y_cpu, x, slots, a, b_t, scaling),
        lambda: F.linear(x, w),
    ]
    twin, cpu, cpu_bt, base = medians_of_interleaved(fns, repeats)
    return {
        "twin_us": round(twin * 1e6, 1),
        "cpu_us": round(cpu * 1e6, 1),
        "cpu_bt_us": round(cpu_bt * 1e6, 1),
        "base_us": round(base * 1e6, 1),
        "overhead": round(cpu / base, 3),
        "speedup": round(twin / cpu, 2),
    }


def gpu_case(in_dim, out_dim, rank, dtype, tokens) -> dict:
    """One case of :func:`gpu_check`: Triton into a column slice vs the twin, and timings."""
    from epdserve.kernels.lora_triton import lora_apply_triton

    g, dev = torch.Generator().manual_seed(tokens), torch.device("cuda")

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

    x, w = rand(tokens, in_dim), rand(out_dim, in_dim, scale=in_dim**-0.5)
    a, b = rand(4, rank, in_dim, scale=in_dim**-0.5), rand(4, out_dim, rank)
    sc = torch.full((4,), 2.0, device=dev)
    slots = slot_pattern("4-mixed", tokens).to(dev)
    wide = rand(tokens, out_dim + 8)
    ref = wide.clone()
    lora_apply_ref(ref[:, 3 : 3 + out_dim], x, slots, a, b, sc)
    y = wide[:, 3 : 3 + out_dim]
    lora_apply_triton(y, x, slots, a, b, sc)
    err = (wide.float() - ref.float()).abs().max().item()
    # fp32: the tests' atol and rtol of 1e-5, rtol on the largest output (sums of 4,096
    # products into outputs of ~70 differ by ~1e-4 with another summation order)
    top = ref.float().abs().max().item()
    tol = 1e-5 + 1e-5 * top if dtype == torch.float32 else 2**-7 * top

    def synced(fn):
        return lambda: (fn(), torch.cuda.synchronize())

    tri, base = medians_of_interleaved(
        [synced(lambda: lora_apply_triton(y, x, slots, a, b, sc)), synced(lambda: F.linear(x, w))],
        21,
    )
    return {"in": in_dim, "out": out_dim, "rank": rank, "tokens": tokens,
            "dtype": str(dtype).removeprefix("torch."), "max_err": err, "tol": tol,
            "ok": err <= tol, "triton_us": round(tri * 1e6, 1),
            "base_us": round(base * 1e6, 1)}  # fmt: skip


def gpu_check() -> int:
    """Triton vs the twin on CUDA; 0 when every case is within tolerance."""
    rows = [
        gpu_case(in_dim, out_dim, rank, dtype, tokens)
        for in_dim, out_dim, rank in ((64, 96, 8), (2048, 2048, 16), (4096, 1024, 64))
        for dtype in (torch.float32, torch.bfloat16)
        for tokens in (1, 37, 512)
    ]
    ok = all(row["ok"] for row in rows)
    print(json.dumps({"device": torch.cuda.get_device_name(), "ok": ok, "cases": rows}, indent=1))
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--gpu", action="store_true", help="Triton on CUDA vs the twin")
    args = parser.parse_args()
    if args.gpu:
        raise SystemExit(gpu_check())
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = LAYERS[1::2] if args.quick else LAYERS
    tokens_list = [1, 64, 512] if args.quick else TOKENS
    patterns = ["one", "4-mixed"] if args.quick else PATTERNS
    cases = []
    for name, in_dim, out_dim, rank in layers:
        for dtype in (torch.bfloat16, torch.float32):
            for tokens in tokens_list:
                for pattern in patterns:
                    work = tokens * in_dim * out_dim
                    repeats = 15 if args.quick else max(21, min(201, int(2e8 // work)))
                    row = run_case(in_dim, out_dim, rank, dtype, tokens, pattern, repeats)
                    cases.append({"layer": name, "dtype": str(dtype).removeprefix("torch."),
                                  "tokens": tokens, "pattern": pattern, **row})  # fmt: skip
    out = {
        "threads": torch.get_num_threads(),
        "cpu_path": "native" if native.available() else "twin",
        "cases": cases,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
