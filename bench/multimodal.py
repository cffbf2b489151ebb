"""Image+text serving: colocated vs encoder/prefill/decode, repeated vs unique images (JSON).

Each pool is started with ``epdserve up`` (tiny random Gemma3) and driven with streamed chat
requests carrying one image each; both pools run the same workloads in the same run.

    python bench/multimodal.py [--requests 24] [--concurrency 4]
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def image_url(seed: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (96, 64), ((seed * 37) % 256, (seed * 91) % 256, (seed * 53) % 256)).save(
        buf, format="PNG"
    )
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pool(model: str, mode: str, workdir: str) -> tuple[subprocess.Popen, str]:
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
    for line in proc.stdout:
        if "ready: OpenAI API" in line:
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"{mode} pool failed to start (see {workdir})")


def stop_pool(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


async def one(client, url: str, image: str, rec: dict) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": "describe the picture"},
                ],
            }
        ],
    }
    start, first = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - start
    rec["ttft"].append(first if first is not None else time.perf_counter() - start)


async def workload(url: str, images: list[str], concurrency: int) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    from epdserve.engine.make_model import make_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model("gemma3", f"{tmp}/gemma3", seed=0))
        workloads = {
            "repeated_image": [image_url(1)] * args.requests,
            "unique_images": [image_url(100 + i) for i in range(args.requests)],
        }
        for mode in ("colocated", "epd"):
            proc, url = start_pool(model, mode, f"{tmp}/{mode}")
            try:
                asyncio.run(workload(url, [image_url(999)], 1))  # warm-up
                results[mode] = {
                    name: asyncio.run(workload(url, imgs, args.concurrency))
                    for name, imgs in workloads.items()
                }
            finally:
                stop_pool(proc)
    print(
        json.dumps(
            {"requests": args.requests, "concurrency": args.concurrency, "pools": results}, indent=2
        )
    )


if __name__ == "__main__":
    main()
