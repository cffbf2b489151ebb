"""Routing quality over real pods, the ``routing`` part of bench/router.py: a shared-prefix
multi-tenant workload through the real router, once per strategy and client count, each from
cold pods (``epdserve serve`` processes or stand-ins) with small KV caches; prefix-hit rate
against an oracle's, TTFT and throughput.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from epdserve.common import metrics_text
from epdserve.router.keys import request_keys

BS = 16  # block size of every pod, index and request key of bench/router.py


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("round-robin", "least-load", "prefix+load")
TENANTS, PREFIX_WORDS, SUFFIX_WORDS, MAX_TOKENS = 6, 150, 30, 8
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kernel",
    "tensor",
    "block",
    "cache",
    "prefix",
    "query",
    "value",
    "token",
    "layer",
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(requests: int) -> list[str]:
    rng = random.Random(7)
    prefixes = [
        " ".join(random.Random(t).choice(WORDS) for _ in range(PREFIX_WORDS))
        for t in range(TENANTS)
    ]
    weights = [1 / (t + 1) for t in range(TENANTS)]  # a few hot tenants, a long tail
    out = []
    for _ in range(requests):
        t = rng.choices(range(TENANTS), weights)[0]
        out.append(prefixes[t] + " " + " ".join(rng.choice(WORDS) for _ in range(SUFFIX_WORDS)))
    return out


def oracle_hit_rate(model_dir: Path, prompts: list[str]) -> float:
    """One infinite cache: every full block seen before is a hit."""
    from epdserve.router.tokenize import PromptTokenizer

    tok, seen, hits, total = PromptTokenizer(model_dir), set(), 0, 0
    for prompt in prompts:
        ids = tok.completion_ids({"prompt": prompt})
        keys = request_keys(ids[:-1], BS)  # the last token is always computed
        n = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        hits, total = hits + n * BS, total + len(ids)
        seen.update(keys)
    return hits / total


def block_bytes(model_dir: Path, dtype_bytes: int = 4) -> int:
    """Bytes of one KV block of the model (all layers, K and V; fp32 by default)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BS * kv_heads * head_dim * dtype_bytes


def start_pod(args, model_dir: Path, logs: Path) -> tuple[subprocess.Popen, str]:
    port, events, replay = free_port(), free_port(), free_port()
    if args.pods == "standin":
        cmd = [sys.executable, str(ROOT / "tests/router/standin_pod.py"), "--model", str(model_dir)]
        cmd += ["--port", str(port), "--events-port", str(events), "--replay-port", str(replay)]
        cmd += ["--num-blocks", str(args.num_blocks), "--prefill-s-per-block", "0.004"]
    else:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": f"kv@127.0.0.1:{port}@tiny",
        }
        cmd = [sys.executable, "-m", "epdserve.engine.cli", "serve", str(model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
        cmd += ["--kv-events-config", json.dumps(config), "--block-size", str(BS)]
        cmd += [
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            str(args.num_blocks * block_bytes(model_dir, 2 if args.dtype == "bfloat16" else 4)),
            "--dtype",
            args.dtype,
        ]
        cmd += args.serve_args.split()
    log = open(logs / f"pod-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port},events={events},replay={replay}"


def wait_up(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited during start-up")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up in {timeout}s")


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Terminate ``procs`` (last started first); kill any that outlive 15 s."""
    for proc in reversed(procs):
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


async def stream_ttft(session, url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> float:
    """Seconds to the first streamed chunk of one greedy completion through ``url``."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        first = None
        async for _ in r.content.iter_any():
            first = first or time.perf_counter()
    return (first or time.perf_counter()) - t0


async def drive(router_url: str, prompts: list[str], concurrency: int) -> dict:
    """``concurrency`` clients in a closed loop; an aiohttp client (C HTTP parser, as vLLM's
    ``bench serve``) so the load generator takes little of the cores the pods share."""
    import aiohttp

    ttfts, queue = [], list(prompts)

    async def worker(session) -> None:
        while queue:
            ttfts.append(await stream_ttft(session, router_url, queue.pop(0)))

    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {
        "ttft_p50_ms": round(percentile(ttfts, 0.5) * 1e3, 1),
        "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1e3, 1),
        "requests_per_s": round(len(prompts) / wall, 2),
        "output_tokens_per_s": round(len(prompts) * MAX_TOKENS / wall, 1),
    }


def pod_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        samples = metrics_text.parse(httpx.get(url.split(",")[0] + "/metrics", timeout=5).text)
        hits += metrics_text.total(samples, "vllm:prefix_cache_hits_total")
        queries += metrics_text.total(samples, "vllm:prefix_cache_queries_total")
    return hits, queries


def run_strategy(
    args, strategy: str, clients: int, model_dir: Path, prompts: list[str], logs: Path
) -> dict:
    procs, specs = [], []
    try:
        for _ in range(args.num_pods):  # fresh pods: every strategy starts from cold caches
            proc, spec = start_pod(args, model_dir, logs)
            procs.append(proc)
            specs.append(spec)
        for spec in specs:
            wait_up(spec.split(",")[0] + ("/health" if args.pods == "standin" else "/ready"), procs)
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "epdserve.engine.cli",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--strategy",
            strategy,
            "--log-level",
            "warning",
        ]
        for spec in specs:
            cmd += ["--endpoint", spec]
        cmd += args.router_args.split()
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_up(f"http://127.0.0.1:{port}/ready", procs, 60)
        hits0, queries0 = pod_counters(specs)
        result = asyncio.run(drive(f"http://127.0.0.1:{port}", prompts, clients))
        hits1, queries1 = pod_counters(specs)
        result["prefix_hit_rate"] = round((hits1 - hits0) / max(1.0, queries1 - queries0), 4)
        return result
    finally:
        stop_all(procs)


def bench_routing(args) -> dict:
    """Every strategy at every client count, each from cold pods; speedups per client count."""
    from epdserve.engine.make_model import make_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    levels = [int(c) for c in str(args.concurrency).split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        try:
            model_dir = Path(make_model("llama", logs / "model", 0, args.preset))
            prompts = workload(args.requests)
            out = {
                "pods": args.pods,
                "num_pods": args.num_pods,
                "kv_blocks_per_pod": args.num_blocks,
                "dtype": args.dtype,
                "requests": args.requests,
                "oracle_hit_rate": round(oracle_hit_rate(model_dir, prompts), 4),
                "by_concurrency": {},
            }
            for level in levels:
                runs = {
                    s: run_strategy(args, s, level, model_dir, prompts, logs) for s in STRATEGIES
                }
                out["by_concurrency"][str(level)] = runs
        except Exception as exc:  # no serve in this build, a pod that crashed: say so in the JSON
            tails = [p.read_text()[-400:] for p in sorted(logs.glob("pod-*.log"))[:1]]
            return {"skipped": f"{type(exc).__name__}: {exc}", "pod_log_tail": tails}
    for runs in out["by_concurrency"].values():
        rr, pl = runs["round-robin"], runs["prefix+load"]
        runs["ttft_p90_speedup_prefix_load_vs_round_robin"] = round(
            rr["ttft_p90_ms"] / max(pl["ttft_p90_ms"], 1e-9), 2
        )
        runs["prefix_load_hit_rate_vs_oracle"] = round(
            pl["prefix_hit_rate"] / max(out["oracle_hit_rate"], 1e-9), 3
        )
    out["targets"] = {"ttft_p90_speedup": 3.0, "hit_rate_vs_oracle": 0.8}
    return out
