"""Image+text serving: colocated vs encoder/prefill/decode, repeated vs unique images, and a
prefill/decode text chat (JSON).

Each pool is started with ``epdserve up`` (tiny random Gemma3) and driven with streamed chat
requests carrying one image each (noise JPEGs of ``--image-size``; the ``pd`` pool: text
only); every pool runs its workloads in
the same run. Besides throughput and TTFT, each workload reports what the request path costs:
- ``cpu_outside_model_ms_per_request``: CPU time of every process of the pool (router, API
  processes, engine cores, Redis) minus the time the cores spent running the model
  (``epdserve:model_cpu_seconds``), per request;
- ``core_input_bytes_per_request``: bytes the API processes sent to their engine cores over
  ZeroMQ (``epdserve:core_input_bytes``), per request.

    python bench/multimodal.py [--requests 24] [--concurrency 4] [--pools colocated,epd,pd]
        [--image-size 640x480]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from epdserve.common import metrics_text

os.environ.setdefault("HF_HUB_OFFLINE", "1")


IMAGE_SIZE = (96, 64)  # --image-size


def image_url(seed: int) -> str:
    """A JPEG of noise (a photo's size and entropy, unlike a flat PNG) as a data URL."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = IMAGE_SIZE
    pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pool(model: str, mode: str, workdir: str) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epdserve.engine.cli",
            "up",
            "--model",
            model,
            "--mode",
            mode,
            "--port",
            str(port),
            "--kv-cache-memory",
            str(128 << 20),
            "--workdir",
            workdir,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    pods = []
    for line in proc.stdout:
        if line.startswith("[epdserve up] starting ") and "(role " in line and " on 127." in line:
            pods.append("http://" + line.rsplit(" on ", 1)[1].split()[0])
        if "ready: OpenAI API" in line:
            return proc, f"http://127.0.0.1:{port}", pods
    raise RuntimeError(f"{mode} pool failed to start (see {workdir})")


def stop_pool(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def tree_cpu(root: int) -> dict[str, float]:
    """utime + stime of ``root``'s descendants alive now (from /proc), by process kind:
    ``router``, ``<role> api`` / ``<role> core`` of each engine pod, ``redis``, ``other``."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    kinds: dict[str, float] = {}
    todo = [(root, "other")]
    while todo:
        pid, parent = todo.pop()
        kind = _kind(pid, parent)
        kinds[kind] = kinds.get(kind, 0.0) + cpu.get(pid, 0.0)
        todo += [(c, kind) for c in children.get(pid, [])]
    return kinds


def _kind(pid: int, parent: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return parent
    if "core_proc" in " ".join(argv):
        return parent.replace(" api", " core")
    if "redis-server" in " ".join(argv):
        return "redis"
    if "serve" in argv:
        role = argv[argv.index("--role") + 1] if "--role" in argv else "both"
        return f"{role} api"
    if "router" in argv:
        return "router"
    return parent


def pod_counters(pods: list[str]) -> dict[str, float]:
    """Model CPU seconds and core input bytes, summed over the pool's pods."""
    sums = {"epdserve:model_cpu_seconds": 0.0, "epdserve:core_input_bytes": 0.0}
    for url in pods:
        text = httpx.get(url + "/metrics", timeout=30).text
        samples = metrics_text.parse(text)
        for name in sums:
            sums[name] += metrics_text.total(samples, name + "_total")
    return sums


def chat_body(image: str | None) -> dict:
    text = {"type": "text", "text": "describe the picture"}
    content = [{"type": "image_url", "image_url": {"url": image}}, text] if image else [text]
    return {
        "model": "tiny",
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }


async def one(client, url: str, image: str | None, rec: dict) -> None:
    body = chat_body(image)
    start, first = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - start
    rec["ttft"].append(first if first is not None else time.perf_counter() - start)


async def workload(url: str, images: list, concurrency: int) -> dict:
    rec = {"ttft": []}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def guarded(image):
            async with sem:
                await one(client, url, image, rec)

        start = time.perf_counter()
        await asyncio.gather(*(guarded(i) for i in images))
        dt = time.perf_counter() - start
    ttft = sorted(rec["ttft"])
    pick = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] * 1e3  # noqa: E731
    return {
        "requests_per_s": len(images) / dt,
        "ttft_p50_ms": pick(0.5),
        "ttft_p90_ms": pick(0.9),
        "seconds": dt,
    }


def measured(proc, url: str, pods: list[str], images: list, concurrency: int) -> dict:
    """One workload with the pool's CPU time (over the workload only: idle ticks of the
    pool's processes are not charged to it) and its core input bytes."""
    time.sleep(1.0)  # let the previous workload's stats reach the API processes
    counters0, cpu0 = pod_counters(pods), tree_cpu(proc.pid)
    result = asyncio.run(workload(url, images, concurrency))
    cpu1 = tree_cpu(proc.pid)
    time.sleep(1.5)  # the cores' stats ride their outputs; the last ones may lag
    counters1 = pod_counters(pods)
    n = len(images)
    model = counters1["epdserve:model_cpu_seconds"] - counters0["epdserve:model_cpu_seconds"]
    sent = counters1["epdserve:core_input_bytes"] - counters0["epdserve:core_input_bytes"]
    by_kind = {k: (v - cpu0.get(k, 0.0)) * 1e3 / n for k, v in sorted(cpu1.items())}
    total = sum(by_kind.values())
    result.update(
        cpu_total_ms_per_request=total,
        model_cpu_ms_per_request=model * 1e3 / n,
        cpu_outside_model_ms_per_request=total - model * 1e3 / n,
        cpu_ms_per_request_by_process={k: round(v, 2) for k, v in by_kind.items()},
        core_input_bytes_per_request=sent / n,
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pools", default="colocated,epd,pd")
    ap.add_argument("--image-size", default="640x480", help="WxH of the request images")
    args = ap.parse_args()
    global IMAGE_SIZE
    IMAGE_SIZE = tuple(int(v) for v in args.image_size.split("x"))
    from epdserve.engine.make_model import make_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model("gemma3", f"{tmp}/gemma3", seed=0))
        image_workloads = {
            "repeated_image": [image_url(1)] * args.requests,
            "unique_images": [image_url(100 + i) for i in range(args.requests)],
        }
        for mode in args.pools.split(","):
            workloads = {"text_chat": [None] * args.requests} if mode == "pd" else image_workloads
            proc, url, pods = start_pool(model, mode, f"{tmp}/{mode}")
            try:
                asyncio.run(workload(url, [image_url(999) if mode != "pd" else None], 1))
                results[mode] = {
                    name: measured(proc, url, pods, imgs, args.concurrency)
                    for name, imgs in workloads.items()
                }
            finally:
                stop_pool(proc)
    print(
        json.dumps(
            {
                "requests": args.requests,
                "concurrency": args.concurrency,
                "image_size": args.image_size,
                "pools": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
