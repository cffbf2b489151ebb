"""Router benchmarks: event ingest rate, prefix lookup latency, and routing quality.

Prints one JSON object:
  * ``ingest``: KV-event batches (msgpack payloads as pods send them) decoded and applied
    to a PrefixIndex; block-events/s (target >= 200k).
  * ``lookup``: request keys + longest-prefix match for a 4k-token prompt over an index of
    100k blocks on 4 pods; p50/p99 ms (target p99 <= 2 ms).
  * ``routing`` (bench/router_quality.py): one shared-prefix multi-tenant workload through
    the real router, once per strategy (round-robin, least-load, prefix+load) and client
    count (``--concurrency 3,6``: one and two clients per pod by default), each from cold
    pods with small KV caches: prefix-hit rate (pods' vllm:prefix_cache_hits/queries) vs the
    oracle's, TTFT p50/p90, throughput. Pods are ``epdserve serve`` processes (bf16 by
    default), or ``--pods standin`` (a simulated prefix cache, for exercising the harness
    only; its times are not an engine's).

    .venv/bin/python bench/router.py [--quick] [--skip-routing] [--pods serve|standin]
        [--concurrency 3,6] [--requests 256] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from router_quality import BS, bench_routing, percentile

from epdserve.connectors.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecoder,
    EventEncoder,
)
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys


def chain_payloads(rng: random.Random, prompts: int, blocks: int, per_event: int) -> list[bytes]:
    """Each prompt: ``blocks`` chained blocks announced ``per_event`` per BlockStored,
    then its last half removed (one hash per BlockRemoved, as vLLM sends them)."""
    enc, payloads = EventEncoder(), []
    for _ in range(prompts):
        parent, hashes = None, []
        for _ in range(blocks // per_event):
            hs = [rng.getrandbits(64) for _ in range(per_event)]
            toks = [rng.randrange(32000) for _ in range(per_event * BS)]
            ev = BlockStored(
                hs, parent, toks, BS, None, "GPU", None, [None] * per_event, 0, "full_attention"
            )
            payloads.append(enc.encode(EventBatch(time.time(), [ev], 0)))
            parent, hashes = hs[-1], hashes + hs
        removed = [BlockRemoved([h], "GPU", 0) for h in reversed(hashes[blocks // 2 :])]
        payloads.append(enc.encode(EventBatch(time.time(), removed, 0)))
    return payloads


def bench_ingest(quick: bool) -> dict:
    rng = random.Random(0)
    prompts = 500 if quick else 3000
    payloads = chain_payloads(rng, prompts, blocks=32, per_event=16)
    block_events = prompts * (32 + 16)
    decoder, index = EventDecoder(), PrefixIndex(capacity=10_000_000)
    pods = [f"pod{i}" for i in range(4)]
    t0 = time.perf_counter()
    for i, payload in enumerate(payloads):
        index.apply(pods[(i // 3) % 4], decoder.decode(payload))
    seconds = time.perf_counter() - t0
    return {
        "block_events": block_events,
        "seconds": round(seconds, 3),
        "block_events_per_s": round(block_events / seconds),
        "target_block_events_per_s": 200_000,
        "index_blocks_after": len(index),
    }


def bench_lookup(quick: bool) -> dict:
    rng = random.Random(1)
    prompt_blocks = 4096 // BS
    index, enc, dec = PrefixIndex(capacity=2_000_000), EventEncoder(), EventDecoder()
    prompts = []
    while len(index) < 100_000:
        toks = [rng.randrange(32000) for _ in range(4096)]
        hs = [rng.getrandbits(64) for _ in range(prompt_blocks)]
        ev = BlockStored(hs, None, toks, BS, None, "GPU", None, [None] * prompt_blocks, 0)
        index.apply(f"pod{len(prompts) % 4}", dec.decode(enc.encode(EventBatch(0.0, [ev], 0))))
        prompts.append(toks)
    pods = [f"pod{i}" for i in range(4)]
    full, match_only = [], []
    for i in range(200 if quick else 2000):
        toks = prompts[rng.randrange(len(prompts))]
        if i % 2:  # a miss after a random cut: a new suffix
            cut = rng.randrange(prompt_blocks) * BS
            toks = toks[:cut] + [rng.randrange(32000) for _ in range(4096 - cut)]
        t0 = time.perf_counter()
        keys = request_keys(toks, BS)
        t1 = time.perf_counter()
        index.match(keys, pods)
        t2 = time.perf_counter()
        full.append((t2 - t0) * 1e3)
        match_only.append((t2 - t1) * 1e3)
    return {
        "indexed_blocks": len(index),
        "prompt_tokens": 4096,
        "p50_ms": round(percentile(full, 0.5), 4),
        "p99_ms": round(percentile(full, 0.99), 4),
        "match_only_p99_ms": round(percentile(match_only, 0.99), 4),
        "target_p99_ms": 2.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (CI smoke)")
    p.add_argument("--skip-routing", action="store_true", help="only ingest and lookup")
    p.add_argument("--pods", choices=("serve", "standin"), default="serve")
    p.add_argument("--num-pods", type=int, default=3)
    p.add_argument("--preset", default="small", help="make-model preset of the served model")
    p.add_argument("--num-blocks", type=int, default=96, help="KV blocks per pod (small caches)")
    p.add_argument("--requests", type=int, default=256, help="requests per strategy and load")
    p.add_argument(
        "--concurrency", default="3,6", help="clients in a closed loop; a comma list runs each"
    )
    p.add_argument("--serve-args", default="", help="extra flags for epdserve serve")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="pods'")
    p.add_argument("--router-args", default="", help="extra flags for epdserve router")
    args = p.parse_args()
    result = {"ingest": bench_ingest(args.quick), "lookup": bench_lookup(args.quick)}
    if not args.skip_routing:
        result["routing"] = bench_routing(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
