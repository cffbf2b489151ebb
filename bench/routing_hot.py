"""Hot prefixes: a Zipf(1.1) tenant mix over 4 pods, offered near the pool's capacity.

Every pod is a real ``epdserve serve`` (colocated, KV events on) that saves its blocks to one
shared ``redis-server`` (``RedisConnector``, ``kv_both``), so a pod that takes a tenant for the
first time can load the tenant's prefix from the store instead of recomputing it. The router
runs each strategy in turn from cold pods and an empty store: ``round-robin``, ``prefix`` (pure
prefix affinity: the longest cached prefix wins, load only breaks ties), ``prefix+load`` and
``prefix+cost``. Each pod's KV cache holds ``--kv-blocks`` blocks, so no pod holds every
tenant's prefix. ``--pods-kind standin`` runs the test stand-in pods instead (tests/router/
standin_pod.py: a simulated prefix cache that sleeps 0.02 s per uncached block, one prompt at a
time, and no store): pods that behave like separate devices rather than processes sharing
this machine's two cores.

Load is open-loop (Poisson arrivals, the same seeded schedule for every strategy) at
``--load`` times the capacity a calibration run measured (a closed loop through
``--calibrate-with``), so the hot tenant's demand exceeds what one pod serves. Prints one JSON:
per strategy TTFT p50/p90, the pods' own prefix-hit rate, store loads and the router's
decisions by reason; then the p90 ratios against round-robin and against pure prefix.

    .venv/bin/python bench/routing_hot.py [--pods 4] [--tenants 16] [--requests 240]
        [--load 0.9] [--rate R] [--preset small] [--kv-blocks 96] [--no-store]
        [--strategies round-robin,prefix,prefix+load,prefix+cost] [--logs DIR]
"""

from __future__ import annotations

import argparse
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
from router_quality import ROOT, WORDS, free_port, percentile, stop_all, stream_ttft, wait_up

from epdserve.common import metrics_text

BS, MAX_TOKENS, PREFIX_WORDS = 32, 8, 300


def workload(args) -> list[tuple[int, str]]:
    """(tenant, prompt) per request: Zipf(``--zipf``) tenant popularity, private tails."""
    rng = random.Random(11)
    prefixes = [
        " ".join(random.Random(100 + t).choice(WORDS) for _ in range(PREFIX_WORDS))
        for t in range(args.tenants)
    ]
    weights = [1 / (k + 1) ** args.zipf for k in range(args.tenants)]
    out = []
    for _ in range(args.requests):
        t = rng.choices(range(args.tenants), weights)[0]
        tail = " ".join(rng.choice(WORDS) for _ in range(args.tail_words))
        out.append((t, prefixes[t] + " " + tail))
    return out


def start_pool(
    args, model: Path, logs: Path, strategy: str, tag: str = ""
) -> tuple[list, str, list[str]]:
    """A fresh redis-server, ``--pods`` pods and a router; returns (procs, router url, pods)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    procs: list[subprocess.Popen] = []
    redis_port = free_port()
    redis = ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"]
    if args.pods_kind == "serve" and not args.no_store:
        procs.append(subprocess.Popen(redis, stdout=subprocess.DEVNULL))
    transfer = {
        "kv_connector": "RedisConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": f"redis://127.0.0.1:{redis_port}/0"},
    }
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    block_bytes = cfg["num_hidden_layers"] * 2 * BS * kv_heads * head_dim * 2  # bf16
    pods = []
    for i in range(args.pods):
        port, events, replay = free_port(), free_port(), free_port()
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        if args.pods_kind == "standin":  # a device-like pod: one prefill at a time, sleeping
            cmd = [sys.executable, str(ROOT / "tests/router/standin_pod.py"), "--model", str(model)]
            cmd += ["--port", str(port), "--events-port", str(events)]
            cmd += ["--replay-port", str(replay), "--block-size", str(BS)]
            cmd += ["--num-blocks", str(args.kv_blocks), "--prefill-s-per-block", "0.02"]
        else:
            cmd = [sys.executable, "-m", "epdserve.engine.cli", "serve", str(model)]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
            cmd += ["--block-size", str(BS), "--max-model-len", "1024", "--dtype", args.dtype]
            cmd += ["--kv-events-config", json.dumps(config)]
            cmd += ["--kv-cache-memory", str(args.kv_blocks * block_bytes)]
            cmd += [] if args.no_store else ["--kv-transfer-config", json.dumps(transfer)]
        log = open(logs / f"{tag or strategy}-pod{i}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        pods.append(f"http://127.0.0.1:{port},events={events},replay={replay}")
    for spec in pods:
        wait_up(
            spec.split(",")[0] + ("/health" if args.pods_kind == "standin" else "/ready"), procs
        )
    port = free_port()
    cmd = [sys.executable, "-m", "epdserve.engine.cli", "router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--model", str(model), "--served-model-name", "tiny"]
    cmd += ["--strategy", strategy, "--block-size", str(BS), "--log-level", "warning"]
    for spec in pods:
        cmd += ["--endpoint", spec]
    cmd += args.router_args.split()
    log = open(logs / f"{tag or strategy}-router.log", "w")  # noqa: SIM115
    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/ready", procs, 60)
    return procs, url, pods


async def closed_loop(url: str, prompts: list[str], clients: int) -> float:
    """Requests per second with ``clients`` back-to-back clients (the calibration)."""
    import aiohttp

    queue = list(prompts)

    async def worker(session) -> None:
        while queue:
            await stream_ttft(session, url, queue.pop(0), MAX_TOKENS)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(clients)))
    return len(prompts) / (time.perf_counter() - t0)


async def open_loop(url: str, work: list[tuple[int, str]], rate: float) -> dict:
    """Poisson arrivals at ``rate``/s (a seeded schedule: the same for every strategy)."""
    import aiohttp

    rng, at, gaps = random.Random(5), 0.0, []
    for _ in work:
        at += rng.expovariate(rate)
        gaps.append(at)
    results: list[tuple[int, float]] = []

    async def send(session, when: float, tenant: int, prompt: str, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + when - time.perf_counter()))
        results.append((tenant, await stream_ttft(session, url, prompt, MAX_TOKENS)))

    # a fresh connection per request: a kept-alive one the server closes when idle can be
    # reset under the next request (uvicorn keep-alive 5 s), and arrivals here are sparse
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(send(session, w, t, p, t0) for w, (t, p) in zip(gaps, work, strict=True))
        )
        wall = time.perf_counter() - t0
    ttfts = [s for _, s in results]
    hot = [s for t, s in results if t == 0]
    return {
        "ttft_p50_ms": round(percentile(ttfts, 0.5) * 1e3, 1),
        "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1e3, 1),
        "hot_tenant_ttft_p90_ms": round(percentile(hot, 0.9) * 1e3, 1) if hot else None,
        "hot_tenant_share": round(len(hot) / len(results), 3),
        "wall_s": round(wall, 1),
    }


def pool_counters(pods: list[str], router: str) -> dict:
    """The pods' prefix-cache and connector counters, the router's decisions by reason."""
    out: dict[str, float] = {"hits": 0.0, "queries": 0.0}
    for spec in pods:
        samples = metrics_text.parse(httpx.get(spec.split(",")[0] + "/metrics", timeout=5).text)
        out["hits"] += metrics_text.total(samples, "vllm:prefix_cache_hits_total")
        out["queries"] += metrics_text.total(samples, "vllm:prefix_cache_queries_total")
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            key, name = "tokens:" + source, "vllm:prompt_tokens_by_source_total"
            out[key] = out.get(key, 0.0) + metrics_text.total(samples, name, source=source)
    samples = metrics_text.parse(httpx.get(router + "/metrics", timeout=5).text)
    for s in samples:
        if s.name == "epdserve_router:requests_total":
            key = "reason:" + s.labels.get("reason", "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def run_strategy(args, model: Path, logs: Path, strategy: str, work, rate: float) -> dict:
    procs, url, pods = start_pool(args, model, logs, strategy)
    try:
        before = pool_counters(pods, url)
        result = asyncio.run(open_loop(url, work, rate))
        after = pool_counters(pods, url)
    finally:
        stop_all(procs)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    result["prefix_hit_rate"] = round(delta.pop("hits") / max(1.0, delta.pop("queries")), 4)
    tokens = {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("tokens:")}
    if sum(tokens.values()):  # stand-in pods do not count tokens by source
        result["prompt_tokens_share"] = {
            k: round(v / sum(tokens.values()), 4) for k, v in tokens.items()
        }
    result["decisions"] = {
        k.split(":", 1)[1]: int(v) for k, v in delta.items() if v and k.startswith("reason:")
    }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pods", type=int, default=4)
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--tail-words", type=int, default=12, help="each request's private words")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--load", type=float, default=0.9, help="offered rate ÷ measured capacity")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (skips calibration)")
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pods-kind", choices=("serve", "standin"), default="serve")
    p.add_argument("--kv-blocks", type=int, default=96, help="KV blocks per pod (of 32 tokens)")
    p.add_argument("--no-store", action="store_true", help="pods without the shared store")
    p.add_argument("--strategies", default="round-robin,prefix,prefix+load,prefix+cost")
    p.add_argument("--router-args", default="", help="extra router flags, e.g. thresholds")
    p.add_argument("--calibrate-with", default="prefix+cost", help="strategy of the calibration")
    p.add_argument("--logs", default="", help="keep the processes' logs in this folder")
    args = p.parse_args()
    from epdserve.engine.make_model import make_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = workload(args)
    out: dict = {"pods": args.pods, "tenants": args.tenants, "zipf": args.zipf}
    out["tail_words"] = args.tail_words
    out.update(requests=args.requests, preset=args.preset, block_size=BS)
    out.update(kv_blocks_per_pod=args.kv_blocks, pods_kind=args.pods_kind)
    out.update(shared_store=not args.no_store and args.pods_kind == "serve")
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        model = Path(make_model("llama", logs / "model", 0, args.preset))
        rate = args.rate
        if not rate:
            procs, url, _ = start_pool(args, model, logs, args.calibrate_with, "calibrate")
            try:
                asyncio.run(closed_loop(url, [w for _, w in work[:8]], 4))  # warm
                capacity = asyncio.run(closed_loop(url, [w for _, w in work[:96]], 2 * args.pods))
            finally:
                stop_all(procs)
            out["capacity_requests_per_s"] = round(capacity, 2)
            rate = args.load * capacity
        out["offered_requests_per_s"] = round(rate, 2)
        runs = {}
        for s in args.strategies.split(","):
            runs[s] = run_strategy(args, model, logs, s, work, rate)
            print(json.dumps({s: runs[s]}), file=sys.stderr, flush=True)
    out["runs"] = runs
    for ours in ("prefix+load", "prefix+cost"):
        for other in ("round-robin", "prefix"):
            if ours in runs and other in runs:
                key = f"ttft_p90_{ours}_vs_{other}".replace("-", "_").replace("+", "_")
                p90 = max(runs[ours]["ttft_p90_ms"], 1e-9)
                out[key] = round(runs[other]["ttft_p90_ms"] / p90, 2)
    out["targets"] = {"ttft_p90_vs_round_robin": 10.0, "ttft_p90_vs_prefix": 1.5}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
