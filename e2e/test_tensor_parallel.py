"""Scenario (issue #38, item 7): a pool whose colocated role has `tensorParallelSize: 2` serves,
through its router, exactly what one engine in this process (TP 1) answers.

The colocated example, adapted to this machine, with one pod of two CPU ranks and
`cpusPerRank: 1` (the node's two cores: the pod asks for cpu 2 and gets EPDSERVE_CPUS=2).
The harness enforces no CPU limit; the engine splits the cores it counts (its affinity within
EPDSERVE_CPUS) between the ranks, so each rank gets one of the node's two cores. Checked: the
rendered pod (the TP setting, cpu and the /dev/shm size limit), the pod itself (two worker
processes pinned to disjoint cores, a /dev/shm of that size holding the ranks' rings, the
engine's log line), greedy completions through the pool's Service with the `openai` client
(concurrent and streamed) equal to `LLM(...)`'s, and a rank killed: the engine core exits at
its next step, the kubelet restarts the container, and the pool answers the same again.
"""

from __future__ import annotations

import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from cluster import wait_for
from pools_e2e import KV_CACHE_BYTES, MODEL_PATH, NS, SMALL_ENGINE, example, for_this_machine, write

pytestmark = pytest.mark.e2e
NAME = "tp-pool"
ENGINES = f"epdserve.io/pool={NAME},epdserve.io/role=colocated"
WORKER = "epdserve.engine.executor.worker_proc"
SHM_LIMIT = 512 << 20  # the operator's 256Mi per CPU rank
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n\nclass Matrix:\n    def __init__(self, rows):" * 3,
    "Once upon a time, " * 20,
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tiny_models) -> dict[str, tuple[str, int]]:
    """prompt -> (greedy text, completion tokens) of one in-process engine (TP 1) with the
    pool's engine settings."""
    from epdserve.engine.llm import LLM
    from epdserve.engine.sampling_params import SamplingParams

    llm = LLM(
        str(tiny_models["llama"]),
        dtype=SMALL_ENGINE["dtype"],
        max_model_len=SMALL_ENGINE["maxModelLen"],
        kv_cache_memory=KV_CACHE_BYTES,
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {
        p: (o.outputs[0].text, len(o.outputs[0].token_ids))
        for p, o in zip(PROMPTS, outs, strict=True)
    }


@pytest.fixture(scope="module")
def pool(cluster, tmp_path_factory):
    """The TP-2 pool, Ready; yields (cluster, openai client on its Service, served name)."""
    body = for_this_machine(example("colocated-text"), MODEL_PATH, replicas={"colocated": 1})
    body["metadata"]["name"] = NAME
    body["spec"]["roles"]["colocated"].update(tensorParallelSize=2, cpusPerRank=1)
    cluster.kubectl("apply", "-f", write(tmp_path_factory.mktemp("tp"), body))
    try:
        cluster.kubectl(
            "wait", f"ipool/{NAME}", "--for=condition=Ready", "--timeout=240s", timeout=260
        )
        ip = cluster.service_ip(NS, NAME)
        client = openai.OpenAI(
            base_url=f"http://{ip}:80/v1", api_key="unused", max_retries=0, timeout=120
        )
        yield cluster, client, body["spec"]["model"]["name"]
    finally:
        cluster.kubectl("delete", "ipool", NAME, "--ignore-not-found", check=False)
        wait_for(
            lambda: not cluster.pods(NS, f"app.kubernetes.io/instance={NAME}"), 60, "pods gone"
        )


def engine_pod(cluster) -> dict:
    (pod,) = cluster.pods(NS, ENGINES)
    return pod


def container_pid(cluster) -> int:
    runtime = cluster.kubelet.pod(NS, engine_pod(cluster)["metadata"]["name"])
    return runtime.containers[0].proc.pid


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (read from /proc, as `ps --ppid` would)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def ranks(cluster) -> list[int]:
    """The pod's worker processes (the mp executor's ranks)."""
    out = []
    for pid in descendants(container_pid(cluster)):
        try:
            if WORKER in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                out.append(pid)
        except OSError:
            continue
    return out


def complete(client, served: str, prompt: str) -> tuple[str, int]:
    out = client.completions.create(
        model=served, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    return out.choices[0].text, out.usage.completion_tokens


def answers_match(client, served: str, reference: dict) -> None:
    """Every prompt at once through the router (the ranks batch them), then one streamed."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = dict(
            zip(PROMPTS, pool.map(lambda p: complete(client, served, p), PROMPTS), strict=True)
        )
    assert got == reference
    stream = client.completions.create(
        model=served, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference[PROMPTS[0]][0]


def test_the_operator_renders_two_ranks_their_cores_and_a_sized_shm(pool):
    cluster, _, _ = pool
    spec = engine_pod(cluster)["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EPDSERVE_TENSOR_PARALLEL_SIZE"] == "2" and env["EPDSERVE_CPUS"] == "2"
    assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"]
    assert container["resources"]["limits"]["cpu"] == "2"
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "512Mi"}


def test_the_pod_runs_two_pinned_ranks_that_share_its_own_shm(pool):
    cluster, _, _ = pool
    workers = ranks(cluster)
    assert len(workers) == 2, f"worker processes of the pod: {workers}"
    cores = [os.sched_getaffinity(pid) for pid in workers]
    assert all(len(c) == 1 for c in cores) and not cores[0] & cores[1], cores
    log = cluster.log(NS, engine_pod(cluster)["metadata"]["name"])
    assert "2 worker processes (tensor parallel), cores" in log
    # /dev/shm as the ranks see it: the pod's tmpfs of the size limit, not the node's
    shm = f"/proc/{workers[0]}/root/dev/shm"
    stat = os.statvfs(shm)
    assert stat.f_blocks * stat.f_frsize == SHM_LIMIT
    rings = {f for f in os.listdir(shm) if f.startswith("psm_")}
    assert len(rings) == 3, rings  # the core's call ring and one reply ring per rank
    assert not rings & set(os.listdir("/dev/shm"))


def test_tp2_pool_answers_as_one_engine_through_its_router(pool, reference):
    cluster, client, served = pool
    answers_match(client, served, reference)


@pytest.mark.slow  # ~30 s with its teardown: CI runs it in make test-slow
def test_a_killed_rank_restarts_the_pod_and_it_answers_the_same(pool, reference):
    cluster, client, served = pool
    name = engine_pod(cluster)["metadata"]["name"]
    os.kill(ranks(cluster)[1], signal.SIGKILL)
    # the core finds the rank gone at its next step (an idle core does not look), fails that
    # request and exits; /health answers 503 and the liveness probe restarts the container
    with contextlib.suppress(openai.APIError):
        complete(client, served, PROMPTS[0])

    def restarted():
        (status,) = cluster.api.get("Pod", NS, name)["status"]["containerStatuses"]
        return status["restartCount"] >= 1 and status["ready"] and len(ranks(cluster)) == 2

    wait_for(restarted, 180, "the engine core to exit and the pod to be ready again")
    assert cluster.log(NS, name).count("2 worker processes (tensor parallel)") == 2
    wait_for(lambda: complete(client, served, PROMPTS[1]), 60, "the router to route to it again")
    answers_match(client, served, reference)
