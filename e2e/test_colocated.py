"""Scenario 1: `kubectl apply` of the colocated example ends in a working OpenAI endpoint."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from cluster import wait_for
from pools_e2e import MODEL_PATH, NS, ROOT, example, for_this_machine, write

pytestmark = pytest.mark.e2e
PROMPT = [{"role": "user", "content": "def fibonacci(n):"}]


def test_kubectl_apply_of_the_colocated_example_serves_streamed_chat(cluster, tmp_path):
    # The CRD helm installed from the chart is crds/ as it stands (no difference to apply).
    cluster.kubectl("diff", "-f", str(ROOT / "crds"))
    pool = for_this_machine(example("colocated-text"), MODEL_PATH)
    name, served = pool["metadata"]["name"], pool["spec"]["model"]["name"]
    cluster.kubectl("apply", "-f", write(tmp_path, pool))
    try:
        cluster.kubectl(
            "wait",
            f"inferencepool/{name}",
            "--for=condition=Ready",
            "--timeout=240s",
            timeout=260,
        )
        ip = cluster.kubectl("get", "service", name, "-o", "jsonpath={.spec.clusterIP}")
        assert cluster.service_ip(NS, name) == ip  # once the node's proxy forwards it
        client = openai.OpenAI(base_url=f"http://{ip}:80/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=served, messages=PROMPT, max_tokens=24, temperature=0, stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length" or any(
            c.choices and c.choices[0].finish_reason for c in chunks
        )
        # The same greedy request straight to an engine pod gives the same text.
        pod_ip = cluster.pods(NS, f"epdserve.io/pool={name}")[0]["status"]["podIP"]
        direct = httpx.post(
            f"http://{pod_ip}:8000/v1/chat/completions",
            json={"model": served, "messages": PROMPT, "max_tokens": 24, "temperature": 0},
            timeout=60,
        ).json()
        assert text and text == direct["choices"][0]["message"]["content"]
        # The headless Service of the role lists both engine pods as ready endpoints.
        slices = cluster.kubectl(
            "get",
            "endpointslices",
            "-l",
            f"kubernetes.io/service-name={name}-colocated",
            "-o",
            "jsonpath={.items[*].endpoints[?(@.conditions.ready==true)].addresses[0]}",
        )
        engines = cluster.pods(NS, f"epdserve.io/pool={name}")
        assert sorted(slices.split()) == sorted(p["status"]["podIP"] for p in engines)
        table = cluster.kubectl("get", "ipool", name)
        header, row = table.splitlines()[:2]
        assert header.split()[:4] == ["NAME", "PHASE", "READY", "ENDPOINT"]
        assert row.split()[1:4] == ["Ready", "3/3", f"http://{name}.{NS}.svc:80"]
        described = cluster.kubectl("describe", "ipool", name)
        assert re.search(r"Phase:\s+Ready", described) and re.search(r"Ready:\s+3/3", described)
        assert re.search(r"Normal\s+Ready\s+\S+\s+epdserve-operator\s+all pods ready", described)
    finally:
        cluster.kubectl("delete", "inferencepool", name, "--wait=false", check=False)
        wait_for(
            lambda: not cluster.pods(NS, f"app.kubernetes.io/instance={name}"),
            60,
            "the pool's pods to go",
        )


def test_a_pool_named_epdserve_starts(cluster, tmp_path):
    pool = for_this_machine(example("colocated-text"), MODEL_PATH, replicas={"colocated": 1})
    pool["metadata"]["name"] = "epdserve"
    cluster.kubectl("apply", "-f", write(tmp_path, pool))
    try:

        def settled():
            engines = cluster.pods(NS, "epdserve.io/pool=epdserve")
            statuses = [s for p in engines for s in p["status"].get("containerStatuses") or []]
            crashed = any(s["restartCount"] for s in statuses)
            ready = statuses and all(s["ready"] for s in statuses)
            return (crashed or ready) and ("ready" if ready and not crashed else "crashed")

        assert wait_for(settled, 180, "the engine to become ready or crash") == "ready"
    finally:
        cluster.kubectl("delete", "inferencepool", "epdserve", "--wait=false", check=False)
        wait_for(lambda: not cluster.pods(NS), 60, "the pool's pods to go")
