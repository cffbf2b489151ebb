"""KV-block save/load throughput of the storage connectors vs their plain-client limits.

Prints one JSON object. For each block geometry (bf16 cross-layer spans) and backend, whole
blocks are saved from a paged cache with ``KVBlockIO.save`` and loaded back into another cache
with ``KVBlockIO.load`` (encode + store + fetch + validate + copy into the slot), in batches.
In the same run, next to each:
  * redis: plain pipelined redis-py (hiredis) SET/GET of same-size values, same batching
    (the client-side limit; ``ratio`` = ours / plain, target >= 0.70), and redis-benchmark's
    raw SET/GET figure (the server's limit, for the record);
  * shared storage: plain ``open().write()`` / ``read()`` of the same bytes to files.
MB/s count tensor payload bytes (1 MB = 1e6 B). A redis-server is started on a free port.
``--codec`` measures the stored-value codec alone instead (format v2 beside format v1's work
and the bare checksums; see ``bench/connector_codec.py``).

    .venv/bin/python bench/connector.py [--quick] [--codec]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time

import redis
import torch

from epdserve.connectors.storage import (
    KVBlockIO,
    KVBlockMeta,
    RedisBlockStore,
    RedisStoreConfig,
    SharedStorageBlockStore,
    SharedStorageConfig,
)

GEOMETRIES = {  # name -> one block [layers, 2, block_size, kv_heads, head_dim] in bf16
    "tiny-32KiB": (4, 2, 16, 2, 64),  # the codec only: per-value overhead dominates
    "small-128KiB": (8, 2, 16, 4, 64),
    "llama8b-2MiB": (32, 2, 16, 8, 128),
}
BATCH = 32  # blocks per save/load call (one engine step's worth)


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def batches(n: int):
    return [list(range(i, min(i + BATCH, n))) for i in range(0, n, BATCH)]


def mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e6, 1)


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port)]
    argv += ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def interleaved(cases: dict, repeats: int) -> dict:
    """Best time of each ``name -> (setup, fn)``, run round-robin so drift on the shared
    CPU hits every case alike."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeats):
        for name, (setup, fn) in cases.items():
            setup()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def kv_functions(store, shape, num_blocks: int) -> tuple:
    """Save and load of ``num_blocks`` bf16 blocks through ``KVBlockIO``, in batches."""
    meta = KVBlockMeta("bench-model", shape[2], "sha256_cbor", shape[3])
    io = KVBlockIO(store, "bench", meta)
    source = torch.randn(num_blocks, *shape).to(torch.bfloat16)
    dest = torch.zeros_like(source)
    hashes = [i.to_bytes(32, "big") for i in range(num_blocks)]
    groups = batches(num_blocks)

    def save():
        for ids in groups:
            assert all(io.save(source, ids, [hashes[i] for i in ids]))

    def load():
        for ids in groups:
            assert all(io.load(dest, ids, [hashes[i] for i in ids]))

    def check():
        assert torch.equal(dest.view(torch.int16), source.view(torch.int16))

    return save, load, check, [io.key(h) for h in hashes]


def plain_redis_functions(client, value_bytes: int, num_blocks: int) -> tuple:
    """Pipelined SET/GET of pre-made values with plain redis-py (hiredis), same batching."""
    values = [os.urandom(value_bytes) for _ in range(min(num_blocks, 64))]
    keys = [f"plain:{i}" for i in range(num_blocks)]
    groups = batches(num_blocks)

    def put():
        for ids in groups:
            pipe = client.pipeline(transaction=False)
            for i in ids:
                pipe.set(keys[i], values[i % len(values)])
            pipe.execute()

    def get():
        for ids in groups:
            pipe = client.pipeline(transaction=False)
            for i in ids:
                pipe.get(keys[i])
            assert all(v is not None for v in pipe.execute())

    return put, get, keys


def redis_benchmark(port: int, value_bytes: int, requests: int) -> dict:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return {"skipped": "redis-benchmark not installed (Debian package redis-tools)"}
    argv = [binary, "-p", str(port), "-t", "set,get", "-d", str(value_bytes), "-n", str(requests)]
    out = subprocess.run([*argv, "-c", "4", "-P", "8", "--csv"], capture_output=True, text=True)
    figures = {}
    for line in out.stdout.splitlines()[1:]:
        fields = [f.strip('"') for f in line.split(",")]
        figures[f"{fields[0].lower()}_MBps"] = mbps(float(fields[1]) * value_bytes, 1.0)
    return figures or {"skipped": f"no output: {out.stderr.strip()[:200]}"}


def plain_file_functions(root: str, value_bytes: int, num_blocks: int) -> tuple:
    """Plain write / write-to-temp-then-rename / read of the same bytes, one file per block;
    reads keep each batch's values, as a batched get must."""
    os.makedirs(root, exist_ok=True)
    value = os.urandom(value_bytes)
    paths = [os.path.join(root, f"plain-{i}") for i in range(num_blocks)]

    def write():
        for path in paths:
            with open(path, "wb") as f:
                f.write(value)

    def write_atomic():
        for path in paths:
            with open(path + ".tmp", "wb") as f:
                f.write(value)
            os.replace(path + ".tmp", path)

    def read():
        for ids in batches(num_blocks):
            values = []
            for i in ids:
                with open(paths[i], "rb") as f:
                    values.append(f.read())

    return write, write_atomic, read


def ratios(times: dict, total: int, pairs) -> dict:
    """MB/s of every case, and ``ours_vs_plain`` = ours MB/s / plain MB/s for each pair."""
    out = {f"{name}_MBps": mbps(total, t) for name, t in times.items()}
    for ours, plain in pairs:
        out[f"{ours}_vs_{plain}"] = round(times[plain] / times[ours], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MB per case instead of 256 MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--codec", action="store_true", help="the codec alone, no store")
    args = parser.parse_args()
    total_bytes = (32 if args.quick else 256) * 10**6
    if args.codec:
        from connector_codec import codec_figures

        result = {"repeats": args.repeats, "total_MB_per_case": total_bytes // 10**6}
        result.update(codec_figures(GEOMETRIES, total_bytes, args.repeats))
        print(json.dumps(result, indent=1))
        return
    torch.manual_seed(0)
    workdir = tempfile.mkdtemp(prefix="epd-bench-")
    proc, port = start_redis(workdir)
    result = {
        "batch_blocks": BATCH,
        "repeats": args.repeats,
        "total_MB_per_case": total_bytes // 10**6,
    }
    try:
        client = redis.Redis(port=port)
        result["redis_server"] = client.info("server")["redis_version"]
        url = f"redis://127.0.0.1:{port}/0"
        for name, shape in GEOMETRIES.items():
            if name.startswith("tiny"):
                continue
            block_bytes = torch.empty(shape, dtype=torch.bfloat16).nbytes
            n = max(BATCH, total_bytes // block_bytes)
            total = block_bytes * n
            case = {"block_bytes": block_bytes, "blocks": n}
            with RedisBlockStore(RedisStoreConfig(url=url)) as store:
                save, load, check, ours = kv_functions(store, shape, n)
                put, get, plain = plain_redis_functions(client, block_bytes, n)
                t = interleaved(
                    {
                        "save": (lambda k=ours: client.delete(*k), save),
                        "set": (lambda k=plain: client.delete(*k), put),
                        "load": (lambda: None, load),
                        "get": (lambda: None, get),
                    },
                    args.repeats,
                )
                check()
            case["redis"] = ratios(t, total, [("save", "set"), ("load", "get")])
            client.flushall()
            case["redis"]["redis_benchmark_raw"] = redis_benchmark(port, block_bytes, min(n, 2000))
            client.flushall()
            root = os.path.join(workdir, f"files-{name}")
            store = SharedStorageBlockStore(SharedStorageConfig(path=root))
            save, load, check, _ = kv_functions(store, shape, n)
            write, write_atomic, read = plain_file_functions(root + "-plain", block_bytes, n)
            t = interleaved(
                {
                    "save": (lambda: None, save),
                    "write": (lambda: None, write),
                    "write_atomic": (lambda: None, write_atomic),
                    "load": (lambda: None, load),
                    "read": (lambda: None, read),
                },
                args.repeats,
            )
            check()
            case["shared_storage"] = ratios(
                t, total, [("save", "write"), ("save", "write_atomic"), ("load", "read")]
            )
            shutil.rmtree(root)
            shutil.rmtree(root + "-plain")
            result[name] = case
        client.close()
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
