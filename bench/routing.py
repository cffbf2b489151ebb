"""Routing precision against the ideal (issue #28): a multi-tenant workload through the real
``epdserve router`` in front of real engine pods of each kind (``epdserve serve``, and ``vllm
serve`` from its own venv), fed by the pods' own ZMQ KV events with replay.

Each tenant has a shared prefix of ``--prefix-tokens`` and each request its own tail of
``--tail-tokens``; the requests are shuffled and sent ``--concurrency`` at a time. Reported per
pod kind: the engines' own prefix-cache hit rate (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, counter deltas summed over pods: a ratio of sums), the hit rate of
an affinity oracle (each tenant always on one pod, no eviction: the exact ideal from the
prompts' tokens and the block size), and ours ÷ ideal, with round-robin for reference. With one
client, a trace says where each lost token went (bench/routing_trace.py).

    python bench/routing.py                      # ours and vLLM pods, 8 tenants, 48 requests
    python bench/routing.py --kinds standin --requests 16   # quick, no engine
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import routing_pods as pods  # noqa: E402
from routing_trace import traced_run  # noqa: E402
from vs_vllm_env import DEFAULT_VENV, make_checkpoint, vllm_version  # noqa: E402

from epdserve.router.keys import request_keys  # noqa: E402
from epdserve.router.tokenize import PromptTokenizer  # noqa: E402

STRATEGIES = ("prefix+load", "round-robin", "prefix+load:salted")
GOAL = 0.95


def single_token_words(tok: PromptTokenizer, limit: int = 600) -> list[str]:
    """Words that are one token each after a space (``" word"``), so prompts made of them have
    exact token counts."""
    vocab = tok._tokenizer.get_vocab()
    words = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3)
    return [w for w in words if len(tok.encode(" " + w, False)) == 1][:limit]


def workload(tok: PromptTokenizer, args, seed: int) -> list[tuple[int, str, list[int]]]:
    """``(tenant, prompt, ids)`` per request: every tenant ``requests // tenants`` times (the
    rest to the first tenants), shuffled. Prompts are exactly prefix + tail tokens long."""
    words = single_token_words(tok)
    special = len(tok.encode("", True))  # a BOS the tokenizer adds, if any
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(" " + rng.choice(words) for _ in range(n))

    prefixes = [text(args.prefix_tokens - special) for _ in range(args.tenants)]
    tenants = [i % args.tenants for i in range(args.requests)]
    rng.shuffle(tenants)
    out = []
    for t in tenants:
        prompt = prefixes[t] + text(args.tail_tokens)
        ids = tok.encode(prompt, True)
        if len(ids) != args.prefix_tokens + args.tail_tokens:
            raise ValueError(f"prompt is {len(ids)} tokens, not prefix + tail")
        out.append((t, prompt, ids))
    return out


def affinity_oracle(requests: list[tuple[int, str, list[int]]], bs: int) -> list[int]:
    """Per request, the hit tokens if its tenant always ran on one pod that never evicts: the
    leading full blocks seen before (the last prompt token is always computed)."""
    seen: dict[int, set[int]] = {}
    hits = []
    for tenant, _, ids in requests:
        cache = seen.setdefault(tenant, set())
        keys = request_keys(ids[:-1], bs)
        hits.append(next((i for i, k in enumerate(keys) if k not in cache), len(keys)) * bs)
        cache.update(request_keys(ids, bs))
    return hits


def run_strategy(args, spec: str, pool, model: Path, requests, ideal, logs: Path) -> dict:
    """One router with ``spec``'s strategy over ``pool``: the pods' own hit rate and the
    oracle's. ``STRATEGY:salted``: every tenant sends its own ``cache_salt``."""
    strategy, _, variant = spec.partition(":")
    router, url = pods.start_router(args, strategy, model, pool, logs)
    client = httpx.Client(timeout=600)

    def post(body: dict) -> None:
        client.post(url + "/v1/completions", json=body).raise_for_status()

    bodies = [
        {"model": "tiny", "prompt": p, "max_tokens": args.max_tokens, "temperature": 0}
        | {"ignore_eos": True}
        | ({"cache_salt": f"tenant-{t}"} if variant == "salted" else {})
        for t, p, _ in requests
    ]
    try:
        before = {p.name: pods.pod_prefix_counters(p) for p in pool.pods}
        trace = None
        if args.concurrency == 1 and not args.no_trace:
            traced = [
                (t, ids, b, h) for (t, _, ids), b, h in zip(requests, bodies, ideal, strict=True)
            ]
            trace = traced_run(url, pool.pods, traced, post, args.block_size)
        else:
            with ThreadPoolExecutor(args.concurrency) as ex:
                list(ex.map(post, bodies))
        after = {p.name: pods.pod_prefix_counters(p) for p in pool.pods}
        decisions = pods.router_best_prefix(url)
    finally:
        client.close()
        pods.stop(router)
    per_pod = {
        n: {"hits": after[n][0] - before[n][0], "queries": after[n][1] - before[n][1]}
        for n in after
    }
    hits = sum(v["hits"] for v in per_pod.values())
    queries = sum(v["queries"] for v in per_pod.values())
    ideal_rate = sum(ideal) / sum(len(ids) for _, _, ids in requests)
    out = {
        "hit_rate": round(hits / max(queries, 1.0), 4),
        "ideal_hit_rate": round(ideal_rate, 4),
        "ratio_vs_ideal": round(hits / max(queries, 1.0) / max(ideal_rate, 1e-9), 3),
        "hits_tokens": hits,
        "queries_tokens": queries,
        "ideal_hits_tokens": sum(ideal),
        "router_best_prefix": decisions,  # none: no pod held any block of the prompt
        "per_pod": {
            n: v | {"hit_rate": round(v["hits"] / max(v["queries"], 1.0), 4)}
            for n, v in per_pod.items()
        },
    }
    if trace is not None:
        out["trace"] = trace
    return out


def run_kind(args, kind: str, model: Path, tok: PromptTokenizer, logs: Path) -> dict:
    """Every strategy over one pool of ``kind``; each strategy gets its own tenants (other
    seeds), so one run's cached prefixes never help the next (KV caches are big enough that
    nothing is evicted)."""
    if kind == "vllm" and vllm_version(Path(args.vllm_venv)) is None:
        return {"skipped": f"no vLLM in {args.vllm_venv}"}
    pool = pods.start_pool(args, kind, model, logs)
    try:
        out = {}
        for n, strategy in enumerate(args.strategies.split(",")):
            requests = workload(tok, args, args.seed + n)
            ideal = affinity_oracle(requests, args.block_size)
            out[strategy] = run_strategy(args, strategy, pool, model, requests, ideal, logs)
    finally:
        pool.stop()
    if "prefix+load" in out:
        out["ours_over_ideal"] = out["prefix+load"]["ratio_vs_ideal"]
    if "round-robin" in out:
        out["round_robin_over_ideal"] = out["round-robin"]["ratio_vs_ideal"]
    if "prefix+load:salted" in out:
        out["ours_salted_over_ideal"] = out["prefix+load:salted"]["ratio_vs_ideal"]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="ours,vllm", help="pod kinds: ours, vllm, standin")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--num-pods", type=int, default=2)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--tail-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32, help="every pod's (vLLM CPU: 32k)")
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per pod")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny", help="make-model preset of the checkpoint")
    p.add_argument("--model", default=None, help="a checkpoint to use instead of making one")
    p.add_argument("--vllm-venv", default=os.environ.get("EPDSERVE_VLLM_VENV", str(DEFAULT_VENV)))
    p.add_argument("--vllm-hash-algo", default="sha256", help="vLLM --prefix-caching-hash-algo")
    p.add_argument("--router-args", default="", help="extra `epdserve router` flags")
    p.add_argument("--no-trace", action="store_true", help="one client: no per-request trace")
    args = p.parse_args(argv)
    for kind in args.kinds.split(","):
        if kind not in pods.KINDS:
            p.error(f"--kinds: unknown kind {kind!r} (choose from {', '.join(pods.KINDS)})")
    if args.prefix_tokens % args.block_size:
        p.error("--prefix-tokens must be a multiple of --block-size (the ideal assumes it)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        model = Path(args.model) if args.model else make_checkpoint(logs / "model", args.preset)
        tok = PromptTokenizer(model)
        result = {
            "workload": {
                k: getattr(args, k)
                for k in ("tenants", "prefix_tokens", "tail_tokens", "requests", "concurrency")
            }
            | {
                "block_size": args.block_size,
                "num_pods": args.num_pods,
                "kv_blocks": args.kv_blocks,
            },
            "goal_ours_over_ideal": GOAL,
        }
        for kind in args.kinds.split(","):
            try:
                result[kind] = run_kind(args, kind, model, tok, logs)
            except Exception as exc:  # a pod that would not start: say so, keep the rest
                tails = {p.name: p.read_text()[-600:] for p in logs.glob(f"{kind}-*.log")}
                result[kind] = {"error": f"{type(exc).__name__}: {exc}", "log_tails": tails}
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
