"""Time to first token of a decode pod that loads a long prompt's KV vs one that recomputes it.

Prints one JSON object. In one process, on the ``small`` preset (fp32 by default):
  * a prefill engine (``kv_producer``) computes each prompt once and saves its blocks;
  * a decode engine (``kv_consumer``) gets the prompt with the prefill's ``kv_transfer_params``:
    it loads every full block (async load, WAITING_FOR_REMOTE_KVS) and computes the rest;
  * a colocated engine (no connector, same config) computes the same prompt from scratch.
TTFT = ``add_request`` -> first token out of ``step()``. Cases alternate, each prompt is fresh
(no local prefix-cache hit), best and median of ``--repeats``. Both backends: shared storage
(a temp dir: page-cache hot) and Redis (a redis-server on a free port). The first tokens of the
load and recompute paths must agree (fp32).

    .venv/bin/python bench/pd_ttft.py [--tokens 2048] [--repeats 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from connector import start_redis  # noqa: E402

from epdserve.engine.config import EngineConfig  # noqa: E402
from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest  # noqa: E402
from epdserve.engine.make_model import make_model  # noqa: E402
from epdserve.engine.sampling_params import SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def engine(model: str, args, transfer: dict | None = None, role: str = "both") -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            max_model_len=args.tokens + 64,
            kv_cache_memory=args.kv_cache_mb << 20,
            max_num_batched_tokens=args.tokens + 64,
            hash_seed="bench",
            kv_transfer_config=json.dumps(transfer) if transfer else None,
            role=role,
        )
    )


def first_token(core: EngineCore, prompt: list[int], params: dict | None, tag: str):
    """(seconds to the first token, the token); the request runs to completion."""
    t0 = time.perf_counter()
    core.add_request(EngineCoreRequest(tag, prompt, ONE_TOKEN, None, 0.0, params))
    while True:
        for out in core.step():
            if out.new_token_ids:
                elapsed = time.perf_counter() - t0
                while core.has_unfinished_requests():
                    core.step()
                return elapsed, out.new_token_ids[0]


def prefill(core: EngineCore, prompt: list[int], tag: str) -> dict:
    core.add_request(
        EngineCoreRequest(tag, prompt, ONE_TOKEN, None, 0.0, {"do_remote_decode": True})
    )
    while core.has_unfinished_requests():
        for out in core.step():
            if out.kv_transfer_params is not None:
                params = out.kv_transfer_params
    return params


def run_backend(model: str, args, extra: dict, connector: str) -> dict:
    cfg = {"kv_connector": connector, "kv_connector_extra_config": extra}
    producer = engine(model, args, {**cfg, "kv_role": "kv_producer"}, "prefill")
    consumer = engine(model, args, {**cfg, "kv_role": "kv_consumer"}, "decode")
    colocated = engine(model, args)
    rng = random.Random(0)
    load, recompute, agree = [], [], True
    for i in range(args.repeats + 1):  # the first round warms up
        prompt = [rng.randrange(10, 4000) for _ in range(args.tokens)]
        params = prefill(producer, prompt, f"p{i}")
        t_load, tok_load = first_token(consumer, prompt, params, f"d{i}")
        t_full, tok_full = first_token(colocated, prompt, None, f"c{i}")
        agree &= tok_load == tok_full
        if i:
            load.append(t_load)
            recompute.append(t_full)
    transfer = consumer.scheduler.kv_transfer
    result = {
        "ttft_load_s": summary(load),
        "ttft_recompute_s": summary(recompute),
        "speedup_median": round(statistics.median(recompute) / statistics.median(load), 2),
        "loaded_tokens_per_request": transfer.hits // (args.repeats + 1),
        "load_failures": transfer.load_failures,
        "first_tokens_agree": agree,
    }
    for core in (producer, consumer, colocated):
        core.close()
    return result


def summary(times: list[float]) -> dict:
    return {"best": round(min(times), 4), "median": round(statistics.median(times), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = tempfile.mkdtemp(prefix="pd-ttft-")
    model = str(make_model("llama", os.path.join(work, "model"), 0, "small"))
    out = {
        "bench": "pd_ttft",
        "preset": "small",
        "dtype": args.dtype,
        "prompt_tokens": args.tokens,
        "repeats": args.repeats,
        "threads": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())),
    }
    out["shared_storage"] = run_backend(
        model, args, {"path": os.path.join(work, "kv")}, "SharedStorageConnector"
    )
    proc, port = start_redis(work)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        out["redis"] = run_backend(model, args, {"url": url}, "RedisConnector")
    finally:
        proc.kill()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
