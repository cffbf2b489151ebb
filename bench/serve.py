"""Serving benchmark: an asyncio load generator against a real ``epdserve serve`` (JSON out).

Also runs the same workload through offline ``LLM.generate`` in the same run and reports
served ÷ offline output throughput (vLLM's own ratio on a 2-core machine is about 0.56).
Offline runs twice: as a user runs it (every CPU) and at the served core's thread count
(every CPU but one, which the API process keeps): ``served_over_offline_at_core_threads``
is the served path's own cost (API process, ZMQ hops, detokenization, SSE), apart from
the CPU the API process needs.

    python bench/serve.py [--requests 64] [--concurrency 64 | --rate 20] [--workload random|shared-prefix]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from epdserve.engine.cpus import core_threads_env

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_workload(kind: str, n: int, seed: int, prompt_len: int, out_len: int):
    rng = random.Random(seed)
    shared = [rng.randrange(10, 4000) for _ in range(prompt_len * 3 // 4)]
    reqs = []
    for _ in range(n):
        if kind == "shared-prefix":
            ids = shared + [rng.randrange(10, 4000) for _ in range(prompt_len - len(shared))]
        else:
            ids = [rng.randrange(10, 4000) for _ in range(prompt_len)]
        reqs.append((ids, out_len))
    return reqs


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    s = sorted(values)

    def p(q):
        return s[min(len(s) - 1, int(q * len(s)))] * 1e3

    return {"p50_ms": p(0.5), "p90_ms": p(0.9), "p99_ms": p(0.99), "mean_ms": sum(s) / len(s) * 1e3}


async def one_request(session, url: str, ids, out_len, rec) -> None:
    body = {
        "model": "bench",
        "prompt": ids,
        "max_tokens": out_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    last, first = None, None
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:  # one SSE line at a time
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            if first is None:
                first = now
                rec["ttft"].append(now - start)
            else:
                rec["itl"].append(now - last)
            last = now
    rec["tokens"] += out_len
    rec["e2e"].append(time.perf_counter() - start)


async def run_load(url: str, reqs, concurrency: int | None, rate: float | None) -> dict:
    """Like vLLM's ``bench serve``: an aiohttp client (C HTTP parser), so the load generator
    takes as little of the machine's cores as it can from the server it measures."""
    import aiohttp

    rec = {"ttft": [], "itl": [], "e2e": [], "tokens": 0}
    connector = aiohttp.TCPConnector(limit=len(reqs) + 8)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sem = asyncio.Semaphore(concurrency or len(reqs))

        async def guarded(ids, out_len):
            async with sem:
                await one_request(session, url, ids, out_len, rec)

        start = time.perf_counter()
        tasks = []
        for ids, out_len in reqs:
            tasks.append(asyncio.create_task(guarded(ids, out_len)))
            if rate:
                await asyncio.sleep(random.expovariate(rate))
        await asyncio.gather(*tasks)
        dt = time.perf_counter() - start
    return {
        "seconds": dt,
        "request_throughput": len(reqs) / dt,
        "output_tok_per_s": rec["tokens"] / dt,
        "ttft": percentiles(rec["ttft"]),
        "itl": percentiles(rec["itl"]),
        "e2e": percentiles(rec["e2e"]),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "epdserve.engine.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--dtype",
        args.dtype,
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        str(args.kv_cache_mb << 20),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become ready")


OFFLINE = """
import json, sys, time
from epdserve.engine import LLM, SamplingParams
spec = json.load(sys.stdin)
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024,
          kv_cache_memory=spec["kv"])
reqs = spec["reqs"]
llm.generate([{"prompt_token_ids": reqs[0][0]}], SamplingParams(max_tokens=2))
llm.engine.kv.reset_prefix_cache()
params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
t = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params)
dt = time.perf_counter() - t
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"seconds": dt, "output_tok_per_s": tokens / dt}))
"""


def offline(model: str, reqs, args, threads: str | None = None) -> dict:
    """``LLM.generate`` in its own process; ``threads`` sets its OpenMP threads."""
    spec = json.dumps(
        {"model": model, "dtype": args.dtype, "reqs": reqs, "kv": args.kv_cache_mb << 20}
    )
    env = {**os.environ, **({"OMP_NUM_THREADS": threads} if threads else {})}
    out = subprocess.run(
        [sys.executable, "-c", OFFLINE],
        input=spec,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model dir (default: a fresh tiny llama)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None, help="requests/s (Poisson)")
    ap.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from epdserve.engine.make_model import make_model

            model = str(make_model("llama", f"{tmp}/tiny", seed=0))
        reqs = make_workload(args.workload, args.requests, 7, args.prompt_len, args.output_len)
        base = offline(model, reqs, args)
        # the served core's own thread count (engine/cpus.py, or OMP_NUM_THREADS)
        core_threads = core_threads_env(model).get("OMP_NUM_THREADS")
        same = offline(model, reqs, args, core_threads)
        proc, url = serve(model, args)
        try:
            asyncio.run(run_load(url, reqs[:4], None, None))  # warm-up
            served = asyncio.run(run_load(url, reqs, args.concurrency, args.rate))
        finally:
            proc.terminate()
            proc.wait(30)
    print(
        json.dumps(
            {
                "workload": {
                    "kind": args.workload,
                    "requests": args.requests,
                    "prompt_len": args.prompt_len,
                    "output_len": args.output_len,
                    "concurrency": args.concurrency,
                    "rate": args.rate,
                    "dtype": args.dtype,
                },
                "served": served,
                "offline": base,
                "offline_at_core_threads": {**same, "threads": core_threads or "inherited"},
                "served_over_offline": served["output_tok_per_s"] / base["output_tok_per_s"],
                # what the served path costs, apart from the core's thread the API keeps
                "served_over_offline_at_core_threads": served["output_tok_per_s"]
                / same["output_tok_per_s"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
