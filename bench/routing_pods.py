"""Processes of ``bench/routing.py``: engine pods of one kind (``ours``: ``epdserve serve``;
``vllm``: ``vllm serve`` from its own venv; ``standin``: the router tests' stand-in pod), each
publishing ZMQ KV events with replay, and ``epdserve router`` in front of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from router_quality import free_port, wait_up
from vs_vllm_env import VLLM_CLI

from epdserve.common import metrics_text

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("ours", "vllm", "standin")


@dataclass
class Pod:
    """One engine pod: its process, HTTP port and event ports."""

    proc: subprocess.Popen
    port: int
    events: int
    replay: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        """The router's name for the pod (router/pods.py: host:port)."""
        return f"127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        """The router's ``--endpoint`` value."""
        return f"{self.url},events={self.events},replay={self.replay}"


@dataclass
class Pool:
    """Pods of one kind, started together and stopped together."""

    kind: str
    pods: list[Pod] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def events_config(port: int, events: int, replay: int) -> str:
    """The ``--kv-events-config`` both engines take (vLLM's field names)."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": f"kv@127.0.0.1:{port}@tiny",
        }
    )


def pod_command(args, kind: str, model: Path, port: int, events: int, replay: int) -> list[str]:
    """The command line of one pod of ``kind``."""
    if kind == "standin":
        cmd = [sys.executable, str(ROOT / "tests/router/standin_pod.py"), "--model", str(model)]
        cmd += ["--port", str(port), "--events-port", str(events), "--replay-port", str(replay)]
        return cmd + ["--block-size", str(args.block_size), "--num-blocks", str(args.kv_blocks)]
    if kind == "vllm":
        head = [str(Path(args.vllm_venv) / "bin/python"), "-c", VLLM_CLI, "serve", str(model)]
        kv = ["--kv-cache-memory-bytes", str(args.kv_blocks * block_bytes(model, args.block_size))]
        kv += ["--enable-prefix-caching", "--prefix-caching-hash-algo", args.vllm_hash_algo]
    else:
        head = [sys.executable, "-m", "epdserve.engine.cli", "serve", str(model)]
        kv = ["--kv-cache-memory", str(args.kv_blocks * block_bytes(model, args.block_size))]
    cmd = head + ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
    cmd += ["--dtype", "bfloat16", "--max-model-len", "2048", "--block-size", str(args.block_size)]
    return cmd + kv + ["--kv-events-config", events_config(port, events, replay)]


def pod_env(kind: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if kind == "vllm":
        # one seed for every vLLM pod: with sha256, vLLM roots its hash chains in
        # PYTHONHASHSEED (a random root per process otherwise); routing does not depend on it
        env |= {"PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        env |= {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return env


def block_bytes(model: Path, block_size: int) -> int:
    """Bytes of one bf16 KV block of the model (every layer, K and V)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * block_size * kv_heads * head_dim * 2


def start_pool(args, kind: str, model: Path, logs: Path) -> Pool:
    """``args.num_pods`` pods of ``kind``, ready (a failed start stops the others)."""
    pool = Pool(kind)
    try:
        for _ in range(args.num_pods):
            port, events, replay = free_port(), free_port(), free_port()
            cmd = pod_command(args, kind, model, port, events, replay)
            log = open(logs / f"{kind}-{port}.log", "w")  # noqa: SIM115 (lives with the pod)
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=pod_env(kind), cwd=logs
            )
            pool.procs.append(proc)
            pool.pods.append(Pod(proc, port, events, replay))
        for pod in pool.pods:
            path = "/health" if kind == "standin" else "/v1/models"
            wait_up(pod.url + path, pool.procs, timeout=900)
    except BaseException:
        pool.stop()
        raise
    return pool


def start_router(args, strategy: str, model: Path, pool: Pool, logs: Path) -> tuple:
    """``epdserve router`` in front of ``pool``: ``(process, url)``, ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "epdserve.engine.cli", "router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--model", str(model), "--served-model-name", "tiny"]
    cmd += ["--strategy", strategy, "--block-size", str(args.block_size)]
    cmd += ["--log-level", "warning"]
    for pod in pool.pods:
        cmd += ["--endpoint", pod.spec]
    cmd += args.router_args.split()
    log = open(logs / f"router-{strategy}-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_up(f"http://127.0.0.1:{port}/ready", [proc], 120)
    except BaseException:
        proc.kill()
        raise
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def pod_prefix_counters(pod: Pod) -> tuple[float, float]:
    """``(hits, queries)`` of a pod's own prefix cache, in tokens (vLLM's counters)."""
    page = metrics_text.parse(httpx.get(pod.url + "/metrics", timeout=10).text)
    hits = metrics_text.total(page, "vllm:prefix_cache_hits_total")
    return hits, metrics_text.total(page, "vllm:prefix_cache_queries_total")


def router_decisions(url: str) -> tuple[dict[tuple[str, str], float], float]:
    """The router's ``requests{pod,reason}`` counters and its matched-blocks counter."""
    page = metrics_text.parse(httpx.get(url + "/metrics", timeout=10).text)
    routed = {
        (s.labels["pod"], s.labels["reason"]): s.value
        for s in page
        if s.name == "epdserve_router:requests_total"
    }
    matched = metrics_text.total(
        page, "epdserve_router:decision_prefix_blocks_total", kind="matched"
    )
    return routed, matched


def router_best_prefix(url: str) -> dict[str, float]:
    """Requests by whether the router sent them to the pod with the longest cached prefix
    (``best``), another pod (``other``) or found none cached (``none``); {} if it has no
    such counter."""
    page = metrics_text.parse(httpx.get(url + "/metrics", timeout=10).text)
    name = "epdserve_router:decision_best_prefix_total"
    return {s.labels["choice"]: s.value for s in page if s.name == name}
