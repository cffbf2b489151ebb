"""A prefill pod + a decode pod over one KV store, driven like vLLM's P/D proxy does."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import httpx
from serving_support import ServerProcess, free_port, wait_ready

from epdserve.common import metrics_text

BLOCK = 16
SEED = "7"  # the pool's shared --hash-seed


def transfer_config(connector: str, role: str, extra: dict) -> str:
    return json.dumps(
        {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    )


class PDPods:
    """``prefill`` (kv_producer) and ``decode`` (kv_consumer) pods sharing one store."""

    def __init__(self, model: str, connector: str, extra: dict, env: dict | None = None):
        self.prefill = self.decode = None
        try:
            self.prefill = _pod(
                model, "prefill", transfer_config(connector, "kv_producer", extra), env
            )
            self.decode = _pod(
                model, "decode", transfer_config(connector, "kv_consumer", extra), env
            )
        except Exception:
            self.stop()
            raise

    def run(self, body: dict) -> tuple[dict, dict]:
        """Prefill with ``max_tokens: 1``, then decode with the handed-over params."""
        first = post(
            self.prefill,
            {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        params = first["kv_transfer_params"]
        assert params is not None and params["do_remote_prefill"] is True
        return first, post(self.decode, {**body, "kv_transfer_params": params})

    def stop(self) -> None:
        for pod in (self.prefill, self.decode):
            if pod is not None:
                pod.stop()


def _pod(model: str, role: str, config: str, env: dict | None = None) -> ServerProcess:
    return ServerProcess(
        model,
        "--role",
        role,
        "--kv-transfer-config",
        config,
        "--hash-seed",
        SEED,
        api_key=None,
        env=env,
    )


def source_tokens(server: ServerProcess, source: str) -> float:
    """``vllm:prompt_tokens_by_source_total{source=...}`` of a pod."""
    body = httpx.get(server.url + "/metrics", timeout=5).text
    found = metrics_text.values(body, "vllm:prompt_tokens_by_source_total", source=source)
    if not found:
        raise AssertionError(f"no prompt-token source {source!r} exported")
    return sum(found)


def post(server: ServerProcess, body: dict) -> dict:
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def prompts(seed: int, lengths=(40, 77, 100, 130)) -> list[list[int]]:
    """Token-id prompts no other test shares (so no pod has them in its local cache)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in lengths]


def greedy(prompt: list[int], max_tokens: int = 12) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }


def answer(response: dict) -> tuple[str, list[str]]:
    """The generated text and its tokens, one by one (token-exact comparison)."""
    choice = response["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def loadable_tokens(prompt: list[int]) -> int:
    """Tokens a decode pod loads of a handed-over prompt: every one but the last (it computes
    that one to sample the first token), the partial last block's included."""
    return len(prompt) - 1


def loadable_blocks(prompt: list[int]) -> int:
    """Blocks that hold them: the full ones, and the partial last one (its tail)."""
    return -(-(len(prompt) - 1) // BLOCK)


def loaded_tokens(prompt: list[int], num_blocks: int) -> int:
    """Tokens the first ``num_blocks`` loadable blocks give a decode pod."""
    return min(num_blocks * BLOCK, loadable_tokens(prompt))


def engine_core(path, role: str | None = None, volume=None, **extra):
    """An in-process engine core (fp32, 512 tokens); ``role`` prefill/decode adds a
    shared-storage KV connector on ``volume``."""
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core.engine_core import EngineCore

    kwargs = dict(model=str(path), dtype="float32", max_model_len=512, **extra)
    if role is not None:
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        transfer = {"kv_connector": "SharedStorageConnector", "kv_role": kv_role}
        transfer["kv_connector_extra_config"] = {"path": str(volume)}
        kwargs.update(role=role, kv_transfer_config=json.dumps(transfer))
    return EngineCore(EngineConfig(**kwargs))


class PDRouter:
    """``epdserve router`` in P/D mode over one prefill and one decode pod (no events)."""

    def __init__(self, model: str, prefill: ServerProcess, decode: ServerProcess):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "epdserve.engine.cli", "router", "--port", str(self.port)]
        cmd += ["--model", model, "--served-model-name", "tiny"]
        cmd += ["--prefill-endpoint", f"{prefill.url},events=none,replay=none"]
        cmd += ["--decode-endpoint", f"{decode.url},events=none,replay=none"]
        self.proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            wait_ready(self.url, self.proc, 60)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
