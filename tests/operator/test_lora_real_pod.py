"""The operator's LoRA contract with a real engine: `epdserve serve` started with exactly the
command and `EPDSERVE_*` environment the builders give a dynamic pool's pod (ConfigMap values
resolved as the kubelet would), then the operator's load/unload pass against it. Slow (an
engine start): run with `-m slow`."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from ipool_samples import pool_body
from k8s_cluster import wait_for
from k8s_server import free_port

from epdserve.operator import engine, lora_sync
from epdserve.operator.spec import parse_pool


def ready(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"the pod exited with {proc.returncode}"
    return httpx.get(url + "/ready", timeout=1).status_code == 200


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama with two random PEFT adapters (loras/lora0, loras/lora1)."""
    from epdserve.engine.make_model import make_model

    return make_model("llama", tmp_path_factory.mktemp("lora-model") / "m", seed=3, lora=2)


def pod_process(pool, port: int) -> subprocess.Popen:
    """The pool's colocated engine pod as a local process on `port`."""
    config_map = engine.build_config_map(pool)["data"]
    container = engine.build_engine_deployment(pool, "colocated")["spec"]["template"]["spec"]
    container = container["containers"][0]
    env = {"OMP_NUM_THREADS": "1"}
    for item in container["env"]:
        ref = (item.get("valueFrom") or {}).get("configMapKeyRef")
        if ref is not None:
            env[item["name"]] = config_map[ref["key"]]
        elif "value" in item and item["name"].startswith("EPDSERVE_"):
            env[item["name"]] = item["value"]
    command = list(container["command"])
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = str(port)
    argv = [sys.executable, "-m", "epdserve.engine.cli", *command[1:]]
    return subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)


@pytest.mark.slow  # ~40 s: torch import, a real engine start
def test_a_real_pod_starts_with_the_configmap_list_and_takes_the_operators_changes(checkpoint):
    adapters = checkpoint / "loras"
    body = pool_body("real", kvEvents={"enabled": False})
    body["spec"]["model"]["source"] = {"path": str(checkpoint)}
    body["spec"]["engine"].update(dtype="float32", maxModelLen=256, kvCacheMemory=16 << 20)
    start = [{"name": "first", "source": {"path": str(adapters / "lora0")}}]
    body["spec"]["lora"] = {"adapters": start, "dynamic": True, "maxLoras": 2}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = pod_process(parse_pool(body), port)
    try:
        wait_for(lambda: ready(url, proc), timeout=120, what="the pod ready")
        client = lora_sync.PodClient()
        assert client.adapters(url) == {"first": str(adapters / "lora0")}
        body["spec"]["lora"]["adapters"] = [
            {"name": "second", "source": {"path": str(adapters / "lora1")}},
            {"name": "missing", "source": {"path": str(adapters / "nope")}},
        ]
        pod = {"metadata": {"name": "real-0"}, "status": {"podIP": "127.0.0.1"}}
        pod["spec"] = {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]}
        served, errors = lora_sync.sync_pod(client, parse_pool(body), pod)
        assert served == {"second"}
        assert errors == [
            f"real-0: load missing: 400 lora_path: {adapters / 'nope'} is not a directory"
        ]
        assert client.adapters(url) == {"second": str(adapters / "lora1")}
        for model, status in (("second", 200), ("first", 404)):
            answer = httpx.post(
                url + "/v1/completions",
                json={"model": model, "prompt": "hello", "max_tokens": 2},
                timeout=60,
            )
            assert answer.status_code == status, answer.text
    finally:
        proc.terminate()
        proc.wait(30)
