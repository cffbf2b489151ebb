"""Served half of ``bench/vs_vllm.py``: ``epdserve serve`` and ``vllm serve`` side by side, both
loaded by the same client, ``vllm bench serve``, one run per call."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import vs_vllm_env as env

# the same engine settings for both servers (vLLM's CPU build needs a block size of 32k)
COMMON = [
    "--served-model-name", "bench", "--dtype", "bfloat16", "--max-model-len", "1024",
    "--block-size", "32", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
    "--enable-prefix-caching", "--seed", "0",
]  # fmt: skip
KV_BYTES = str(1 << 30)
# (prompts, random input, output, shared prefix) per case; --quick: smaller
CASES = {
    "random": ((64, 128, 128, 0), (16, 128, 32, 0)),
    "shared_prefix": ((64, 128, 128, 512), (16, 128, 32, 256)),
}
RESULT_KEYS = (
    "completed", "request_throughput", "output_throughput", "total_token_throughput",
    "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
    "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "median_tpot_ms", "median_e2el_ms",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class ServedPair:
    """Both servers up at once (an idle server's CPU is measured and reported), so rounds can
    alternate without paying start-up between them."""

    def __init__(self, vllm_python: str, model: Path, threads: int, quick: bool):
        self.vllm_python, self.model, self.threads, self.quick = vllm_python, model, threads, quick
        self.tmp = Path(tempfile.mkdtemp(prefix="vs-vllm-serve-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}

    def command(self, name: str, port: int) -> list[str]:
        if name == "vllm":
            head = [self.vllm_python, "-c", env.VLLM_CLI, "serve", str(self.model)]
            tail = ["--kv-cache-memory-bytes", KV_BYTES, "--disable-uvicorn-access-log"]
        else:
            head = [sys.executable, "-m", "epdserve.engine.cli", "serve", str(self.model)]
            tail = ["--kv-cache-memory", KV_BYTES, "--log-level", "warning"]
        return head + ["--port", str(port), *COMMON, *tail]

    def start(self) -> None:
        for name in ("epdserve", "vllm"):
            port = free_port()
            log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 (lives as long as the server)
            self.procs[name] = subprocess.Popen(
                self.command(name, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env.thread_env(self.threads)},
            )
            self.urls[name] = f"http://127.0.0.1:{port}"
        for name in self.procs:
            self.wait_ready(name)

    def wait_ready(self, name: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                tail = (self.tmp / f"{name}.log").read_text()[-2000:]
                raise RuntimeError(f"{name} server exited during start-up:\n{tail}")
            try:
                with urllib.request.urlopen(self.urls[name] + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{name} server not ready after {timeout} s")

    def client_command(self, name: str, case: str, seed: int) -> list[str]:
        n, inp, out, prefix = CASES[case][1 if self.quick else 0]
        cmd = [self.vllm_python, "-c", env.VLLM_CLI, "bench", "serve", "--backend", "openai"]
        cmd += ["--base-url", self.urls[name], "--model", "bench", "--tokenizer", str(self.model)]
        cmd += ["--dataset-name", "random", "--random-input-len", str(inp)]
        cmd += ["--random-output-len", str(out), "--num-prompts", str(n)]
        cmd += ["--request-rate", "inf", "--ignore-eos", "--seed", str(seed), "--disable-tqdm"]
        cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
        cmd += ["--save-result", "--result-dir", str(self.tmp), "--result-filename", "run.json"]
        if prefix:
            cmd += ["--random-prefix-len", str(prefix)]
        return cmd

    def bench(self, name: str, case: str, seed: int, args) -> dict:
        """One ``vllm bench serve`` run against ``name``; its result, plus CPU seconds per
        process of the server under test, of the idle one, and of the client."""
        other = "vllm" if name == "epdserve" else "epdserve"
        result_file = self.tmp / "run.json"
        result_file.unlink(missing_ok=True)
        quiet_wait = env.wait_quiet([p.pid for p in self.procs.values()])
        before = {n: env.process_cpu(p.pid) for n, p in self.procs.items()}
        client_before = client_cpu_s()
        res = subprocess.run(self.client_command(name, case, seed), capture_output=True, text=True)
        if res.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"vllm bench serve against {name} failed:\n{res.stdout[-2000:]}"
                               f"\n{res.stderr[-2000:]}")  # fmt: skip
        after = {n: env.process_cpu(p.pid) for n, p in self.procs.items()}
        data = json.loads(result_file.read_text())
        out = {k: data[k] for k in RESULT_KEYS if k in data}
        out["server_cpu_s"] = env.cpu_delta(before[name], after[name])
        if other in before:
            out["other_server_idle_cpu_s"] = env.cpu_delta(before[other], after[other])
        out["waited_for_quiet_s"] = quiet_wait
        out["client_cpu_s"] = round(client_cpu_s() - client_before, 3)
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
