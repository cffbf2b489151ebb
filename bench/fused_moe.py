"""fused_moe on CPUs: the torch twin vs the grouped path (plain and prepacked bf16 experts).

Prints one JSON object. For each case (hidden ``H``, expert intermediate ``I``, experts
``E``, top ``k``, tokens ``T``; bf16, random routing) the functions run interleaved and
their medians are reported in milliseconds:

- ``twin_ms``: ``moe_ref.fused_moe_ref`` (every expert masked in turn; the torch backend);
- ``grouped_ms``: ``moe_ref.fused_moe_grouped`` on the stacked ``[E, 2I, H]`` tensors;
- ``packed_ms``: the same on per-expert oneDNN-packed matrices (what ``MoeLM`` gives the
  native backend).

``--gpu``: the Triton kernel on CUDA against the twin on CUDA (largest difference, medians).
On a shared 2-core machine ``--threads 1`` gives steadier figures.

    .venv/bin/python bench/fused_moe.py [--quick] [--threads N] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from epdserve.kernels.linear import pack
from epdserve.kernels.moe_ref import fused_moe_grouped, fused_moe_ref

# (name, H, I, E, k): a Mixtral-like and a Qwen3-MoE-like layer, scaled down to fit a laptop
LAYERS = [("mixtral-like", 1024, 512, 8, 2), ("qwen3moe-like", 1024, 256, 64, 8)]
TOKENS = [1, 16, 256]


def case(h: int, i: int, e: int, k: int, t: int, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(device, dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(device, dtype)
    weights, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k, dim=-1)
    return x, w13, w2, weights.to(device), ids.to(device)


def medians(fns: dict, repeats: int, sync=lambda: None) -> dict:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so load changes hit all alike
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {f"{n}_ms": round(statistics.median(v), 3) for n, v in times.items()}


def cpu(args) -> list[dict]:
    rows = []
    for name, h, i, e, k in LAYERS[:1] if args.quick else LAYERS:
        for t in TOKENS:
            c = case(h, i, e, k, t)
            x, w13, w2, weights, ids = c
            packed = (x, [pack(w) for w in w13.unbind(0)], [pack(w) for w in w2.unbind(0)],
                      weights, ids)  # fmt: skip
            row = dict(layer=name, H=h, I=i, E=e, k=k, T=t)
            fns = {
                "twin": lambda c=c: fused_moe_ref(*c),
                "grouped": lambda c=c: fused_moe_grouped(*c),
                "packed": lambda p=packed: fused_moe_grouped(*p),
            }
            row.update(medians(fns, 3 if args.quick else 15))
            row["speedup"] = round(row["twin_ms"] / row["packed_ms"], 2)
            rows.append(row)
    return rows


def gpu(args) -> list[dict]:
    from epdserve.kernels.moe_triton import fused_moe_triton

    rows = []
    for name, h, i, e, k in LAYERS:
        for t in TOKENS + [2048]:
            for dtype in (torch.float32, torch.bfloat16):
                c = case(h, i, e, k, t, "cuda", dtype)
                diff = (fused_moe_triton(*c).float() - fused_moe_ref(*c).float()).abs().max()
                row = dict(layer=name, T=t, dtype=str(dtype), max_diff=round(diff.item(), 5))
                row.update(
                    medians(
                        {"twin": lambda c=c: fused_moe_ref(*c),
                         "triton": lambda c=c: fused_moe_triton(*c)},
                        10, torch.cuda.synchronize,
                    )
                )  # fmt: skip
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = gpu(args) if args.gpu else cpu(args)
    print(json.dumps({"threads": torch.get_num_threads(), "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
