"""As vLLM: a pod's port opens only once its engine can serve, and an engine that cannot
start ends the process (so the pod restarts) instead of answering 503 forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
from serving_support import free_port


def serve(model: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "epdserve.engine.cli", "serve", model, "--port", str(port)]
    cmd += ["--served-model-name", "tiny", "--max-model-len", "512", *flags]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, f"http://127.0.0.1:{port}"


def test_the_first_answer_of_a_starting_pod_is_a_healthy_one(models):
    proc, url = serve(str(models.get("llama")), "--kv-cache-memory", str(64 << 20))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "the pod never opened"
            try:
                health = httpx.get(url + "/health", timeout=2)
                break
            except httpx.TransportError:  # port still closed: the engine is starting
                time.sleep(0.05)
        assert health.status_code == 200
        body = {"model": "tiny", "prompt": "x = 1", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.terminate()
        proc.wait(15)


def test_an_engine_that_cannot_start_ends_the_process(models):
    # 4 KiB of KV cache cannot hold one 512-token sequence: the engine core refuses to start
    proc, _ = serve(str(models.get("llama")), "--kv-cache-memory", str(1 << 12))
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "kv_cache_memory" in output


def test_asking_for_cuda_without_one_fails_at_start_naming_why(models):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc, _ = serve(str(models.get("llama")), "--device", "cuda")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "device: cuda was asked for, but torch sees no CUDA device" in output
    assert "Traceback" not in output


def test_device_auto_is_the_cpu_here_and_the_default(models):
    import torch

    from epdserve.engine.config import EngineConfig

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig(model=str(models.get("llama"))).device == expected
    assert EngineConfig(model=str(models.get("llama")), device="auto").device == expected
