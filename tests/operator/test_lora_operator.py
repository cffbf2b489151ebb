"""The operator on the real control plane, driven with kubectl: a dynamic pool's changed
adapter list reaches a running pod (a real HTTP stub on this host) through load/unload calls,
without rolling its Deployment, and the status lists the adapters."""

from __future__ import annotations

import json

from ipool_samples import pool_body
from k8s_cluster import NS, deployment, wait_for
from lora_stub_pod import StubPod

SQL = {"name": "sql", "source": {"path": "/opt/adapters/sql"}}
CHAT = {"name": "chat", "source": {"path": "/opt/adapters/chat"}}


def ready_pod(cluster, name: str, pool: str, port: int) -> None:
    """A running, ready engine pod of the pool at the stub's address: created by hand (no
    pod-template-hash, so no ReplicaSet adopts it), its status written as a kubelet would."""
    labels = {"epdserve.io/pool": pool, "epdserve.io/role": "colocated"}
    container = {"name": "engine", "image": "img:1"}
    container["ports"] = [{"name": "http", "containerPort": port}]
    body = {"metadata": {"name": name, "labels": labels}, "spec": {"containers": [container]}}
    cluster.core.create_namespaced_pod(NS, body)
    status = {"podIP": "127.0.0.1", "phase": "Running"}
    status["conditions"] = [{"type": "Ready", "status": "True"}]
    cluster.core.patch_namespaced_pod_status(name, NS, {"status": status})


def lora_status(cluster, name: str) -> dict:
    return ((cluster.pool(NS, name) or {}).get("status") or {}).get("lora") or {}


def test_a_dynamic_pool_loads_a_changed_list_on_running_pods_without_a_rollout(cluster, make_pool):
    body = pool_body("dyn")
    body["spec"]["lora"] = {"adapters": [SQL], "dynamic": True, "maxLoras": 2}
    make_pool(body)
    first = wait_for(lambda: deployment(cluster, "dyn-colocated"), what="engine Deployment")
    command = first.spec.template.spec.containers[0].command
    assert "--allow-runtime-lora-updating" in command and "--lora-modules" not in command
    with StubPod() as pod:
        ready_pod(cluster, "dyn-colocated-0", "dyn", pod.port)
        try:
            wait_for(lambda: pod.changes() == [("load", "sql")], what="sql loaded")
            wait_for(
                lambda: (
                    lora_status(cluster, "dyn").get("colocated", {}).get("adapters")
                    == [{"name": "sql", "pods": "1/1"}]
                ),
                what="status lists sql on 1/1 pods",
            )
            patch = {"spec": {"lora": {"adapters": [CHAT]}}}
            cluster.kubectl(
                *("patch", "inferencepool", "dyn", "-n", NS, "--type", "merge"),
                *("-p", json.dumps(patch)),
            )
            wait_for(lambda: pod.adapters == {"chat": "/opt/adapters/chat"}, what="chat only")
            assert pod.changes() == [("load", "sql"), ("unload", "sql"), ("load", "chat")]
            config = cluster.core.read_namespaced_config_map("dyn-config", NS)
            assert config.data["lora-modules"] == "chat=/opt/adapters/chat"
            wait_for(
                lambda: (
                    lora_status(cluster, "dyn").get("colocated", {}).get("adapters")
                    == [{"name": "chat", "pods": "1/1"}]
                ),
                what="status lists chat",
            )
        finally:
            cluster.core.delete_namespaced_pod("dyn-colocated-0", NS)
    after = deployment(cluster, "dyn-colocated")
    assert after.metadata.generation == first.metadata.generation
    assert after.spec.template == first.spec.template


def test_a_refused_load_shows_in_the_status_and_as_a_warning_event(cluster, make_pool):
    body = pool_body("bad-lora")
    body["spec"]["lora"] = {"adapters": [SQL], "dynamic": True}
    make_pool(body)
    wait_for(lambda: deployment(cluster, "bad-lora-colocated"), what="engine Deployment")
    with StubPod() as pod:
        pod.refuse["sql"] = "adapter_config.json is missing in /opt/adapters/sql"
        ready_pod(cluster, "bad-lora-colocated-0", "bad-lora", pod.port)
        try:
            errors = wait_for(
                lambda: lora_status(cluster, "bad-lora").get("colocated", {}).get("errors"),
                what="the load error in the status",
            )
            assert errors == [
                "bad-lora-colocated-0: load sql: 400 adapter_config.json is missing in "
                "/opt/adapters/sql"
            ]

            def warnings():
                events = cluster.core.list_namespaced_event(NS).items
                return [
                    e
                    for e in events
                    if e.reason == "LoraSyncFailed" and e.involved_object.name == "bad-lora"
                ]

            (event,) = wait_for(warnings, what="LoraSyncFailed event")[:1]
            assert event.type == "Warning" and "adapter_config.json is missing" in event.message
        finally:
            cluster.core.delete_namespaced_pod("bad-lora-colocated-0", NS)
