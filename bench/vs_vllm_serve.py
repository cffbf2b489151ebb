"""Served half of ``bench/vs_vllm.py``: ``epdserve serve`` or ``vllm serve``, one at a time,
loaded by the same client, ``vllm bench serve``."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import vs_vllm_env as env

# (prompts, random input, output, shared prefix) per case; --quick: smaller
CASES = {
    "random": ((64, 128, 128, 0), (16, 128, 32, 0)),
    "shared_prefix": ((64, 128, 128, 512), (16, 128, 32, 256)),
}
WARM_UP = (16, 128, 32, 0)
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


class Server:
    """One server of one engine in one setting and variant, alone on the machine: started,
    loaded by ``vllm bench serve`` run by run, stopped."""

    def __init__(self, vllm_python: str, model: Path, name: str, flags: list, env_: dict, tmp):
        self.vllm_python, self.model, self.name, self.tmp = vllm_python, model, name, Path(tmp)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        if name == "vllm":
            head = [vllm_python, "-c", env.VLLM_CLI, "serve", str(model)]
        else:
            head = [sys.executable, "-m", "epdserve.engine.cli", "serve", str(model)]
        self.log_path = self.tmp / f"{name}-{port}.log"
        log = open(self.log_path, "w")  # noqa: SIM115 (lives as long as the server)
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [*head, "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT, env=env_
        )
        self.wait_ready()
        self.start_s = round(time.monotonic() - started, 1)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"{self.name} server exited during start-up:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} server not ready after {timeout} s")

    def client_command(self, shape: tuple, seed: int) -> list[str]:
        n, inp, out, prefix = shape
        cmd = [self.vllm_python, "-c", env.VLLM_CLI, "bench", "serve", "--backend", "openai"]
        cmd += ["--base-url", self.url, "--model", "bench", "--tokenizer", str(self.model)]
        cmd += ["--dataset-name", "random", "--random-input-len", str(inp)]
        cmd += ["--random-output-len", str(out), "--num-prompts", str(n)]
        cmd += ["--request-rate", "inf", "--ignore-eos", "--seed", str(seed), "--disable-tqdm"]
        cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
        cmd += ["--save-result", "--result-dir", str(self.tmp), "--result-filename", "run.json"]
        if prefix:
            cmd += ["--random-prefix-len", str(prefix)]
        return cmd

    def bench(self, shape: tuple, seed: int) -> dict:
        """One ``vllm bench serve`` run; its result, plus the server's CPU seconds per
        process and the client's."""
        result_file = self.tmp / "run.json"
        result_file.unlink(missing_ok=True)
        quiet_wait = env.wait_quiet([self.proc.pid])
        before, client_before = env.process_cpu(self.proc.pid), client_cpu_s()
        res = subprocess.run(self.client_command(shape, seed), capture_output=True, text=True)
        if res.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"vllm bench serve against {self.name} failed:\n"
                               f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")  # fmt: skip
        data = json.loads(result_file.read_text())
        out = {k: data[k] for k in RESULT_KEYS if k in data}
        out["server_cpu_s"] = env.cpu_delta(before, env.process_cpu(self.proc.pid))
        out["waited_for_quiet_s"] = quiet_wait
        out["client_cpu_s"] = round(client_cpu_s() - client_before, 3)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_server(vllm_python, model, name, flags, env_, tmp, runs: list[tuple]) -> list[dict]:
    """Start one server, warm it up (not counted), run ``runs`` (``(shape, seed)``), stop it.
    Each result notes the server's start-up seconds."""
    server = Server(vllm_python, model, name, flags, env_, tmp)
    try:
        server.bench(WARM_UP, seed=1)
        results = [server.bench(shape, seed) for shape, seed in runs]
    finally:
        server.stop()
    for res in results:
        res["server_start_s"] = server.start_s
    return results
