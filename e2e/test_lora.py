"""Scenario (issue #29): the LoRA example pool serves three adapters through its router.

`examples/inferencepool-lora.yaml`, adapted to this machine: the tiny model and the three
adapters `make-model --lora 3` writes, all baked into the engine image at /opt/lora-llama and
named by `path` sources. The official `openai` client, through the pool's Service (the
router), gets for the base model and each adapter name the answer a single
`epdserve serve --enable-lora` process (outside the cluster, same checkpoint and adapters)
gives, plain and streamed; mixed concurrently they still do; an adapter nobody serves is a 404 through the router.
Not marked slow: it costs what test_colocated.py's first scenario does (one engine and a
router start, plus the single pod alongside; 23-45 s here under other sessions' load).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from cluster import wait_for
from pools_e2e import (
    KV_CACHE_BYTES,
    NS,
    example,
    for_this_machine,
    readable_copy,
    ready_pod_ips,
    write,
)

from epdserve.common import metrics_text

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~50 s: CI runs it after make test
BIN = Path(sys.executable).parent
IMAGE_MODEL = "/opt/lora-llama"  # where the engine image carries the model and its adapters
# the example's adapter names, each backed by one `make-model --lora 3` adapter
ADAPTERS = {"sql": "lora0", "support-de": "lora1", "summarise": "lora2"}
PROMPT = [{"role": "user", "content": "Write a query that lists every customer:"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def lora_model(e2e_workdir) -> Path:
    """The tiny Llama with three random PEFT adapters in loras/lora{0,1,2}, world-readable."""
    from epdserve.engine.make_model import make_model

    built = make_model("llama", e2e_workdir / "build" / "lora-llama", seed=0, lora=3)
    return readable_copy(Path(built), e2e_workdir / "image" / "lora-llama")


@contextlib.contextmanager
def in_image(cluster, path: str, source: Path):
    """Pods started meanwhile find `source` at `path` (read-only), as if the image had it."""
    entry = {"path": path, "source": str(source)}
    cluster.node.image_files.append(entry)
    try:
        yield
    finally:
        cluster.node.image_files.remove(entry)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_pod(model: Path, served: str, engine: dict, log: Path):
    """`epdserve serve --enable-lora` with the same checkpoint, adapters and engine settings
    as the pool's pods, on loopback; yields its base URL once it is ready."""
    port = free_port()
    argv = [str(BIN / "epdserve"), "serve", str(model), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--served-model-name", served, "--dtype", engine["dtype"]]
    argv += ["--max-model-len", str(engine["maxModelLen"])]
    argv += ["--kv-cache-memory", str(KV_CACHE_BYTES), "--enable-lora", "--max-loras"]
    argv += ["4", "--max-lora-rank", "64"]
    for name, adapter in ADAPTERS.items():
        argv += ["--lora-modules", f"{name}={model / 'loras' / adapter}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the pool's pods (the node's image env)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, f"the single pod exited: {log.read_text()[-3000:]}"
        return httpx.get(url + "/ready", timeout=2).status_code == 200

    try:
        yield url, ready
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def chat(base: str, model: str) -> tuple[str, str, int, str]:
    """(model, text, completion tokens, finish reason) of a greedy chat answer."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = out.choices[0]
    return out.model, choice.message.content, out.usage.completion_tokens, choice.finish_reason


def streamed(base: str, model: str) -> tuple[str, str, int, str]:
    """chat()'s tuple, from a streamed answer (usage from the last chunk)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert {c.model for c in chunks} == {model}
    return model, text, chunks[-1].usage.completion_tokens, finish[-1]


def served_per_adapter(ips: list[str]) -> dict[str, float]:
    pages = [httpx.get(f"http://{ip}:8000/metrics", timeout=10).text for ip in ips]
    name = "epdserve:lora_requests_total"
    return {a: sum(metrics_text.total(p, name, lora_name=a) for p in pages) for a in ADAPTERS}


def test_the_lora_pool_answers_each_adapter_through_its_router_as_a_single_pod(
    cluster, lora_model, tmp_path
):
    # one engine replica (the example has two): the pool's start stays within ~30 s here
    replicas = {"colocated": 1, "router": 1}
    pool = for_this_machine(example("inferencepool-lora"), IMAGE_MODEL, replicas)
    name, served = pool["metadata"]["name"], pool["spec"]["model"]["name"]
    assert set(ADAPTERS) == {a["name"] for a in pool["spec"]["lora"]["adapters"]}
    pool["spec"]["lora"]["adapters"] = [
        {"name": n, "source": {"path": f"{IMAGE_MODEL}/loras/{a}"}} for n, a in ADAPTERS.items()
    ]
    models = [served, *ADAPTERS]
    log = tmp_path / "single-pod.log"
    with (
        in_image(cluster, IMAGE_MODEL, lora_model),
        single_pod(lora_model, served, pool["spec"]["engine"], log) as (single, ready),
    ):
        cluster.kubectl("apply", "-f", write(tmp_path, pool))
        try:
            cluster.kubectl(
                "wait", f"ipool/{name}", "--for=condition=Ready", "--timeout=240s", timeout=260
            )
            wait_for(ready, 120, "the single pod to be ready")
            router = f"http://{cluster.service_ip(NS, name)}:80"
            listing = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
            assert {m.id for m in listing.models.list()} >= set(models)

            want = {model: chat(single, model) for model in models}
            for model in models:  # one at a time, streamed too, then all at once (mixed)
                assert chat(router, model) == want[model], model
                assert streamed(router, model) == want[model], model
            with ThreadPoolExecutor(len(models) * 2) as executor:
                got = list(executor.map(lambda m: chat(router, m), models * 2))
            assert got == [want[m] for m in models * 2]

            assert all(w[0] == m and w[2] == MAX_TOKENS for m, w in want.items())
            texts = [w[1] for w in want.values()]
            assert len(set(texts)) == len(texts), f"adapters changed nothing: {texts}"
            with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
                chat(router, "no-such-adapter")
            # the pool's engines ran each routed request with its adapter: 2 + 2 per name
            engines = ready_pod_ips(cluster, f"epdserve.io/pool={name}")
            wait_for(
                lambda: served_per_adapter(engines) == dict.fromkeys(ADAPTERS, 4.0),
                30,
                "the engines' per-adapter counters",
            )
        finally:
            cluster.kubectl("delete", "ipool", name, "--ignore-not-found", check=False)
            wait_for(
                lambda: not cluster.pods(NS, f"app.kubernetes.io/instance={name}"),
                90,
                "the pool's pods to go",
            )
