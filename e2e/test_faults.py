"""Scenario 4: faults and changes under a running pool (colocated engines + managed Redis).

An engine process killed mid-load is restarted by the kubelet and the router drops and
re-adds it, with no failure for a request that had not started streaming; a killed Redis
pod leaves answers correct (recompute); scaling up adds pods to routing; deleting the pool
ends every process it had.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from cluster import leaked_processes, wait_for
from pools_e2e import (
    MODEL_PATH,
    NS,
    Workers,
    example,
    failure,
    for_this_machine,
    pod_names,
    ready_pod_ips,
    write,
)

from epdserve.common import metrics_text

pytestmark = pytest.mark.e2e
NAME = "faults"
ENGINES = f"epdserve.io/pool={NAME}"
ROUTER = f"epdserve.io/router={NAME}"
REDIS = f"epdserve.io/redis={NAME}"


def chat(client, served: str, prompt: str, max_tokens: int = 16) -> str:
    out = client.chat.completions.create(
        model=served,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return out.choices[0].message.content


@pytest.fixture(scope="module")
def pool(cluster, tmp_path_factory):
    """A colocated pool of two engines that share KV blocks through an operator-managed Redis."""
    body = for_this_machine(example("colocated-text"), MODEL_PATH)
    body["metadata"]["name"] = NAME
    body["spec"]["cache"] = {"backend": "redis", "redis": {"managed": True}}
    served = body["spec"]["model"]["name"]
    cluster.kubectl("apply", "-f", write(tmp_path_factory.mktemp("p"), body))
    cluster.kubectl("wait", f"ipool/{NAME}", "--for=condition=Ready", "--timeout=240s", timeout=260)
    ip = cluster.service_ip(NS, NAME)
    client = openai.OpenAI(base_url=f"http://{ip}/v1", api_key="unused", max_retries=0)
    yield cluster, client, served
    cluster.kubectl("delete", "ipool", NAME, "--ignore-not-found", check=False)


def diagnose(cluster) -> str:
    """What a failure message needs: the router pod's restarts and its log's last lines."""
    pods = [cluster.api.get("Pod", NS, n) for n in pod_names(cluster, ROUTER)]
    restarts = [c["restartCount"] for p in pods for c in p["status"]["containerStatuses"]]
    tail = router_log(cluster).splitlines()[-40:]
    return f"router restarts {restarts}; router log:\n" + "\n".join(tail)


def router_log(cluster) -> str:
    return "".join(cluster.log(NS, n) for n in pod_names(cluster, ROUTER))


class Load(Workers):
    """Streaming chat requests from a few threads until stopped; records every outcome."""

    def __init__(self, client, served: str, workers: int = 3):
        self.client, self.served = client, served
        self.results: list[tuple[bool, str | None]] = []  # (had started streaming, error)
        super().__init__(workers)

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            started, error = False, None
            try:
                stream = self.client.chat.completions.create(
                    model=self.served,
                    messages=[{"role": "user", "content": f"worker {worker} request {n}: hello"}],
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    timeout=120,
                )
                for _ in stream:
                    started = True
            except Exception as exc:
                error = failure(exc)
            self.results.append((started, error))


def test_a_killed_engine_is_restarted_and_no_unstarted_request_fails(pool):
    cluster, client, served = pool
    victim = pod_names(cluster, ENGINES)[0]
    victim_ip = cluster.api.get("Pod", NS, victim)["status"]["podIP"]
    runtime = cluster.kubelet.pod(NS, victim)
    with Load(client, served) as load:
        wait_for(lambda: len(load.results) >= 6, 120, "traffic before the kill")
        os.killpg(runtime.containers[0].proc.pid, signal.SIGKILL)  # the container dies
        wait_for(
            lambda: f"pod {victim_ip}:8000 removed" in router_log(cluster), 60, "router drops it"
        )
        restarted = wait_for(
            lambda: (
                (s := cluster.api.get("Pod", NS, victim)["status"])["containerStatuses"][0][
                    "restartCount"
                ]
                >= 1
                and victim_ip in ready_pod_ips(cluster, ENGINES)
                and s
            ),
            180,
            "the kubelet to restart the container and the pod to be ready again",
        )
        assert restarted["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 137
        log = router_log(cluster)
        wait_for(
            lambda: router_log(cluster).count(f"pod {victim_ip}:8000 added") >= 2,
            60,
            "router re-adds it",
        )
        done = len(load.results)
        wait_for(lambda: len(load.results) >= done + 6, 120, "traffic after the restart")
    assert log
    unstarted_failures = [err for started, err in load.results if err and not started]
    assert not unstarted_failures, (
        len(unstarted_failures),
        unstarted_failures[:3],
        diagnose(cluster),
    )
    assert sum(1 for _, err in load.results if not err) >= 12


def test_killing_the_redis_pod_keeps_answers_correct(pool):
    cluster, client, served = pool
    prompts = [f"import os\nprint({i})" * 6 for i in range(3)]
    before = [chat(client, served, p) for p in prompts]
    (redis_pod,) = pod_names(cluster, REDIS)
    cluster.kubectl("delete", "pod", redis_pod, "--wait=false")
    # While Redis is gone, and after the Deployment has replaced it, answers do not change.
    assert [chat(client, served, p) for p in prompts] == before
    wait_for(
        lambda: (names := pod_names(cluster, REDIS)) and redis_pod not in names,
        60,
        "a new Redis pod",
    )
    wait_for(lambda: ready_pod_ips(cluster, REDIS), 60, "the new Redis pod ready")
    fresh = [p + "\n# again" for p in prompts]
    first = [chat(client, served, p) for p in fresh]
    assert [chat(client, served, p) for p in fresh] == first
    assert [chat(client, served, p) for p in prompts] == before


@pytest.mark.slow  # ~47 s: CI runs it after make test
def test_scaling_up_adds_pods_to_routing(pool):
    cluster, client, served = pool
    patch = '{"spec": {"roles": {"colocated": {"replicas": 3}}}}'
    cluster.kubectl("patch", "ipool", NAME, "--type=merge", "-p", patch)
    ips = wait_for(
        lambda: len(ips := ready_pod_ips(cluster, ENGINES)) == 3 and ips, 180, "3 ready engines"
    )
    cluster.kubectl(
        "wait",
        f"ipool/{NAME}",
        "--for=jsonpath={.status.roles.colocated.ready}=3",
        "--timeout=120s",
        timeout=140,
    )
    router_ip = ready_pod_ips(cluster, ROUTER)[0]

    def routed_to_all() -> bool:
        threads = [
            threading.Thread(target=chat, args=(client, served, f"scale {time.time()} {i}", 24))
            for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        text = httpx.get(f"http://{router_ip}:8000/metrics", timeout=10).text
        return all(
            metrics_text.total(text, "epdserve_router:requests_total", pod=f"{ip}:8000") > 0
            for ip in ips
        )

    wait_for(routed_to_all, 120, "requests routed to every pod, new ones included", interval=0)


def test_deleting_the_pool_ends_every_process(pool):
    cluster, _, _ = pool
    runtimes = [
        r
        for r in list(cluster.kubelet.pods.values())
        if r.obj["metadata"]["labels"].get("app.kubernetes.io/instance") == NAME
    ]
    groups = {c.proc.pid for r in runtimes for c in r.containers if c.proc}
    assert groups and leaked_processes(groups)
    cluster.kubectl("delete", "ipool", NAME)
    wait_for(lambda: not cluster.api.list("Pod", NS), 60, "every pod object gone")
    wait_for(lambda: not leaked_processes(groups), 60, "every pod process gone")
    namespaces = {r.netns for r in runtimes}
    wait_for(lambda: not namespaces & set(cluster.network.namespaces), 60, "netns removed")
