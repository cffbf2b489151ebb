"""Fair tenants (issue #28): a light tenant's TTFT alone, and beside a heavy tenant sending 10x
its traffic, through the real ``epdserve router`` with the fair queue off and on.

One ``epdserve serve`` pod (``--max-num-seqs``) and several routers in front of it, all with
the same tenant keys: ``off`` forwards everything at once (the pod's own FCFS queue decides);
each ``on_N+R`` admits N requests per pod by weighted fairness plus R slots only for a tenant
under its share (``--fair N:R``). The light tenant is one client sending ``--light-requests``
streamed requests back to back; the heavy tenant is ``--heavy-clients`` such clients in a loop
(10 clients: 10x the light tenant's request rate while they share the pod), in a process of
its own. Reported: the light tenant's TTFT p50/p90 per phase, its p90 over the solo p90
(measured before and after the heavy phases; goal <= 2), and the heavy tenant's output
tokens/s over the ``off`` router's (what the fair queue costs the heavy tenant).

    python bench/fairness.py                   # ~3 min on 2 cores
    python bench/fairness.py --light-requests 10 --heavy-clients 4   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from router_quality import free_port, stop_all, wait_up  # noqa: E402
from vs_vllm_env import make_checkpoint  # noqa: E402

from epdserve.common import metrics_text  # noqa: E402

HEAVY, LIGHT = "sk-heavy", "sk-light"
GOAL = 2.0
PROMPT = "the quick brown fox jumps over the lazy dog " * 6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: a tiny make-model llama)")
    p.add_argument("--preset", default="tiny", help="make-model preset without --model")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the pod's batch bound")
    p.add_argument(
        "--fair",
        nargs="+",
        default=["6:2", "4:2", "2:2"],
        help="fair-queue routers to compare, each --max-inflight-per-pod:--tenant-reserve-per-pod",
    )
    p.add_argument("--light-requests", type=int, default=30)
    p.add_argument("--heavy-clients", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", help="also write the JSON here")
    return p.parse_args(argv)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stream_once(client: httpx.Client, key: str, max_tokens: int) -> tuple[float, int]:
    """One streamed completion: (seconds to its first token, tokens received)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    start, first, tokens = time.perf_counter(), None, 0
    headers = {"Authorization": f"Bearer {key}"}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text"):
                first = first or time.perf_counter() - start
                tokens += 1
    return first if first is not None else time.perf_counter() - start, tokens


async def _heavy_clients(url: str, clients: int, max_tokens: int, stop, done, tokens) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {HEAVY}"}
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def loop() -> None:
            while not stop.is_set():
                r = await client.post("/v1/completions", json=body, headers=headers)
                r.raise_for_status()
                with done.get_lock():
                    done.value += 1
                    tokens.value += r.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(loop() for _ in range(clients)))


def heavy_process(url: str, clients: int, max_tokens: int, stop, done, tokens) -> None:
    """The heavy tenant in its own process (its clients must not take the light client's
    GIL): ``clients`` back-to-back requests at a time (not streamed: only the light tenant's
    first token is timed, and parsing 10 streams would load this 2-core machine's CPUs)."""
    asyncio.run(_heavy_clients(url, clients, max_tokens, stop, done, tokens))


def phase(url: str, args, heavy: bool) -> dict:
    """The light tenant's requests, with or without the heavy tenant's clients running."""
    ctx = multiprocessing.get_context("spawn")
    stop, done, tokens = ctx.Event(), ctx.Value("l", 0), ctx.Value("l", 0)
    worker = None
    if heavy:
        worker = ctx.Process(
            target=heavy_process,
            args=(url, args.heavy_clients, args.max_tokens, stop, done, tokens),
        )
        worker.start()
        time.sleep(3.0)  # the heavy tenant fills the pod first
    began = time.perf_counter()
    with done.get_lock():  # heavy work is counted over the light tenant's window only
        done_before, tokens_before = done.value, tokens.value
    with httpx.Client(base_url=url, timeout=300) as client:
        ttfts = [stream_once(client, LIGHT, args.max_tokens)[0] for _ in range(args.light_requests)]
    elapsed = time.perf_counter() - began
    with done.get_lock():
        heavy_done, heavy_tokens = done.value - done_before, tokens.value - tokens_before
    stop.set()
    if worker is not None:
        worker.join(120)
    out = {
        "light_ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "light_ttft_p90_ms": round(1000 * percentile(ttfts, 0.9), 1),
        "light_requests": len(ttfts),
    }
    page = httpx.get(url + "/metrics", timeout=10).text
    waits = [
        metrics_text.total(page, f"epdserve_router:tenant_queue_seconds_{k}", tenant="light")
        for k in ("sum", "count")
    ]
    if waits[1]:  # the router's own view: time the light tenant waited in its queue
        out["light_queue_mean_ms_so_far"] = round(1000 * waits[0] / waits[1], 2)
    if heavy:  # completed during the light tenant's requests
        out |= {
            "heavy_requests_done": heavy_done,
            "heavy_tokens_per_s": round(heavy_tokens / elapsed, 1),
        }
    return out


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def router_cmd(port: int, pod_url: str, keys: Path, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "epdserve.engine.cli", "router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--strategy", "least-load", "--kv-replay-port", "0"]
    cmd += ["--endpoint", pod_url, "--tenant-keys", str(keys), "--log-level", "warning"]
    return cmd + extra


def main(argv=None) -> dict:
    args = parse_args(argv)
    fairs = [tuple(int(x) for x in spec.split(":")) for spec in args.fair]
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp:
        logs = Path(tmp)
        model = Path(args.model) if args.model else make_checkpoint(logs / "model", args.preset)
        keys = logs / "tenants.json"
        tenants = [{"name": "heavy", "keys": [HEAVY]}, {"name": "light", "keys": [LIGHT]}]
        keys.write_text(json.dumps({"tenants": tenants}))
        pod_port = free_port()
        pod_cmd = [sys.executable, "-m", "epdserve.engine.cli", "serve", str(model)]
        pod_cmd += ["--host", "127.0.0.1", "--port", str(pod_port), "--served-model-name", "tiny"]
        pod_cmd += ["--dtype", "bfloat16", "--max-num-seqs", str(args.max_num_seqs)]
        procs = [start(pod_cmd, logs / "pod.log")]
        try:
            pod_url = f"http://127.0.0.1:{pod_port}"
            wait_up(pod_url + "/v1/models", procs, timeout=600)
            routers = {"off": []} | {
                f"on_{n}+{r}": [
                    "--max-inflight-per-pod",
                    str(n),
                    "--tenant-reserve-per-pod",
                    str(r),
                ]
                for n, r in fairs
            }
            urls = {}
            for name, extra in routers.items():
                port = free_port()
                procs.append(start(router_cmd(port, pod_url, keys, extra), logs / f"{name}.log"))
                urls[name] = f"http://127.0.0.1:{port}"
            for url in urls.values():
                wait_up(url + "/ready", procs, timeout=120)
            phase(urls["off"], args, heavy=False)  # warm-up: compile paths, caches
            results = {"solo_off": phase(urls["off"], args, heavy=False)}
            for name, url in urls.items():
                results[f"heavy_{name}"] = phase(url, args, heavy=True)
            results["solo_off_again"] = phase(urls["off"], args, heavy=False)
        finally:
            stop_all(procs)
    return report(args, results, list(urls))


def report(args, results: dict, routers: list[str]) -> dict:
    """Ratios against the solo p90 (the mean of the runs before and after the heavy ones)."""
    solo = (
        results["solo_off"]["light_ttft_p90_ms"] + results["solo_off_again"]["light_ttft_p90_ms"]
    ) / 2
    heavy_off = results["heavy_off"]["heavy_tokens_per_s"]
    out = {
        "bench": "fairness",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "phases": results,
        "solo_light_ttft_p90_ms": round(solo, 1),
        "light_p90_over_solo": {
            name: round(results[f"heavy_{name}"]["light_ttft_p90_ms"] / solo, 2) for name in routers
        },
        "heavy_tokens_per_s_over_off": {
            name: round(results[f"heavy_{name}"]["heavy_tokens_per_s"] / max(heavy_off, 1e-9), 2)
            for name in routers
        },
        "goal_light_p90_over_solo": GOAL,
    }
    out["goal_met_by"] = [n for n, v in out["light_p90_over_solo"].items() if v <= GOAL]
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
