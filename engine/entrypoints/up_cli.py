"""``epdserve up``: a whole pool on one machine, no cluster — the main job of ``make run``.

Starts, as local processes: a ``redis-server`` (disaggregated modes), the engine pods
(``epdserve serve`` with KV events on), and the cache-aware router on the public port. The
pool's processed-prompt key is drawn afresh and reaches the engines and the router through
their environment, as the operator's Secret does, never a command line.
Ctrl-C (or SIGTERM) stops everything, children first.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("colocated", "pd", "epd")
PROMPT_KEY_ENV = "EPDSERVE_PROCESSED_PROMPT_KEY"  # the serve and router flag's variable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: build a tiny one under models/)")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="pd",
        help="colocated engines, prefill/decode, or encoder/prefill/decode",
    )
    p.add_argument("--replicas", type=int, default=1, help="engine pods (colocated mode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--strategy", default="prefix+load")
    p.add_argument("--workdir", help="logs and sockets (default: a temporary directory)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pool:
    """The processes of a local pool; ``stop()`` ends them all."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        # the pool's processed-prompt key, as the operator's Secret gives it to its pods
        self.key_env = {PROMPT_KEY_ENV: secrets.token_hex(32)}

    def spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (lives with the process)
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode}; see "
                    f"{self.workdir / (name + '.log')}"
                )


def wait_http(pool: Pool, url: str, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool.check_alive()
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not become ready in {timeout:.0f}s")


def say(message: str) -> None:
    print(f"[epdserve up] {message}", flush=True)


def epdserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "epdserve.engine.cli", *args]


def ensure_model(args) -> str:
    """``--model``, else a tiny checkpoint for the mode under models/ (built once)."""
    if args.model:
        config = Path(args.model) / "config.json"
        if args.mode == "epd" and "vision_config" not in (
            json.loads(config.read_text()) if config.is_file() else {}
        ):
            raise SystemExit(
                f"epdserve up: --mode epd needs an image+text model; {args.model} has no "
                "vision tower (leave --model out for a tiny Gemma3)"
            )
        return args.model
    arch = "gemma3" if args.mode == "epd" else "llama"
    path = Path("models") / f"tiny-{arch}"
    if not (path / "config.json").is_file():
        say(f"building a tiny {arch} model in {path} ...")
        from epdserve.engine.make_model import make_model

        make_model(arch, path, seed=0)
    return str(path)


def start_redis(pool: Pool) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found (apt-get install redis-server)")
    port = free_port()
    pool.spawn("redis", redis_command(binary, port, pool.workdir))
    return f"redis://127.0.0.1:{port}/0"


def redis_command(binary: str, port: int, workdir) -> list[str]:
    """A throwaway local redis-server: loopback only, no persistence, bounded like the
    operator's managed one (1 GiB, least recently used keys go first)."""
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(workdir), "--maxmemory", "1gb",
            "--maxmemory-policy", "allkeys-lru"]  # fmt: skip


def start_engine(pool: Pool, args, model: str, name: str, role: str, extra: list[str]) -> str:
    port, ev, rp = free_port(), free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ev}",  # "*" binds (vLLM rule)
        "replay_endpoint": f"tcp://*:{rp}",
        "topic": f"kv@127.0.0.1:{port}@{args.served_model_name}",
    }
    cmd = epdserve_cmd(
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        args.served_model_name,
        "--dtype",
        args.dtype,
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--hash-seed",
        "epdserve-up",
        "--kv-events-config",
        json.dumps(events),
        *extra,
    )
    if role != "both":
        cmd += ["--role", role]
    say(f"starting {name} (role {role}) on 127.0.0.1:{port} ...")
    pool.spawn(name, cmd, {"EPDSERVE_POD_IP": "127.0.0.1", **pool.key_env})  # events: loopback
    wait_http(pool, f"http://127.0.0.1:{port}/ready")
    say(f"{name} ready")
    return f"http://127.0.0.1:{port},events={ev},replay={rp}"


def start_pool(pool: Pool, args, model: str) -> None:
    router_endpoints: list[str] = []
    if args.mode == "colocated":
        for i in range(args.replicas):
            router_endpoints += [
                "--endpoint",
                start_engine(pool, args, model, f"engine-{i}", "both", []),
            ]
    else:
        say("starting redis-server ...")
        url = start_redis(pool)

        def kv(role: str, ec_role: str) -> list[str]:
            kv_config = {
                "kv_connector": "RedisConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"url": url},
            }
            return ["--kv-transfer-config", json.dumps(kv_config), *ec(ec_role)]

        def ec(role: str) -> list[str]:
            # image outputs travel through the store: later pods get a processed prompt
            # that names the images, never the images themselves
            config = {
                "ec_connector": "RedisECConnector",
                "ec_role": role,
                "ec_connector_extra_config": {"url": url},
            }
            return ["--ec-transfer-config", json.dumps(config)]

        if args.mode == "epd":
            enc = start_engine(pool, args, model, "encoder", "encoder", ec("ec_producer"))
            router_endpoints += ["--encoder-endpoint", enc]
        router_endpoints += [
            "--prefill-endpoint",
            start_engine(pool, args, model, "prefill", "prefill", kv("kv_producer", "ec_both")),
        ]
        router_endpoints += [
            "--decode-endpoint",
            start_engine(pool, args, model, "decode", "decode", kv("kv_consumer", "ec_consumer")),
        ]
    say(f"starting the router on http://{args.host}:{args.port} ...")
    pool.spawn(
        "router",
        epdserve_cmd(
            "router",
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--model",
            model,
            "--served-model-name",
            args.served_model_name,
            "--strategy",
            args.strategy,
            *router_endpoints,
        ),
        pool.key_env,
    )
    wait_http(pool, f"http://{args.host}:{args.port}/ready")


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="epdserve-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    pool = Pool(workdir)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        model = ensure_model(args)
        start_pool(pool, args, model)
        say(
            f"ready: OpenAI API at http://{args.host}:{args.port}/v1 (model "
            f"'{args.served_model_name}'); logs in {workdir}; Ctrl-C stops everything"
        )
        say(f"router metrics: http://{args.host}:{args.port}/metrics")
        while True:
            pool.check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        say("stopping ...")
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        # a second signal (Ctrl-C twice, `make` passing SIGTERM on) must not cut the stop
        # short: it is bounded anyway (SIGTERM, 15 s, SIGKILL)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        pool.stop()
        say("stopped")
    return 0
