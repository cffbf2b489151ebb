"""The operator converges through what a real control plane does to it: the API server
killed mid-reconcile, etcd killed while a role scales, an expired watch (etcd compacted,
the API server restarted: the resumed watch answers 410 Gone and the operator relists),
and writers that conflict with it (an object of its child's name made by hand first: the
pool names it and waits until it is gone; a child scaled by hand). After each, every child exists once, with the pool as its owner,
and each role has exactly its replicas as pods.
"""

from __future__ import annotations

import json
import signal

import pytest
from cluster import OPERATOR_NS, wait_for
from pools_e2e import MODEL_PATH, NS, condition, example, for_this_machine, write

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~70 s idle, ~130 s loaded: CI runs it
NAME = "faults"


def children(cluster, kind: str) -> list[dict]:
    out = cluster.kubectl("get", kind, "-n", NS, "-l", f"epdserve.io/pool={NAME}", "-o", "json")
    return json.loads(out)["items"]


def converged(cluster, engines: int) -> bool:
    """The pool is Ready with `engines` engine pods, every child once and owned by it."""
    pool = json.loads(cluster.kubectl("get", "ipool", NAME, "-o", "json"))
    status = pool.get("status") or {}
    if status.get("phase") != "Ready" or status.get("ready") != f"{engines + 1}/{engines + 1}":
        return False
    uid = pool["metadata"]["uid"]
    deployments = children(cluster, "deployments")
    names = sorted(d["metadata"]["name"] for d in deployments)
    assert names == [f"{NAME}-colocated", f"{NAME}-router"], names
    for kind in ("deployments", "services"):
        for child in children(cluster, kind):
            owners = [o["uid"] for o in child["metadata"].get("ownerReferences") or []]
            assert owners == [uid], f"{kind} {child['metadata']['name']}: owners {owners}"
    live = [p for p in cluster.pods(NS, f"epdserve.io/pool={NAME}")]
    running = [p for p in live if not p["metadata"].get("deletionTimestamp")]
    replica_sets = [
        rs for rs in children(cluster, "replicasets") if (rs["spec"].get("replicas") or 0) > 0
    ]
    return len(running) == engines and len(replica_sets) == 1


def degraded(cluster) -> dict:
    pool = json.loads(cluster.kubectl("get", "ipool", NAME, "-o", "json"))
    found = condition(pool, "Degraded")
    return found if found.get("status") == "True" else {}


def watch_restarts(cluster) -> int:
    """How often kopf restarted a watch after 410 Gone (its debug line says so)."""
    return cluster.operator_log().count("Restarting the watch-stream")


def operator_restarts(cluster) -> list[int]:
    pods = cluster.pods(OPERATOR_NS, "app.kubernetes.io/name=epdserve-operator")
    return [s["restartCount"] for p in pods for s in p["status"].get("containerStatuses") or []]


def scale(cluster, replicas: int) -> None:
    patch = {"spec": {"roles": {"colocated": {"replicas": replicas}}}}
    cluster.kubectl("patch", "ipool", NAME, "--type=merge", "-p", json.dumps(patch))


def test_the_operator_converges_through_control_plane_faults(cluster, tmp_path):
    control = cluster.control
    pool = for_this_machine(example("colocated-text"), MODEL_PATH, replicas={"colocated": 1})
    pool["metadata"]["name"] = NAME
    # A Service of the pool's name made by hand first: the operator's create gets 409
    # AlreadyExists; the object is not the pool's, so the pool says so and waits.
    cluster.kubectl("create", "service", "clusterip", NAME, "--tcp=9999:9999", "-n", NS)
    cluster.kubectl("apply", "-f", write(tmp_path, pool))
    try:
        foreign = wait_for(lambda: degraded(cluster), 60, "the pool to name the foreign Service")
        assert foreign["reason"] == "ForeignObject" and f"Service {NS}/{NAME}" in foreign["message"]
        svc = json.loads(cluster.kubectl("get", "service", NAME, "-o", "json"))
        assert [p["port"] for p in svc["spec"]["ports"]] == [9999]  # left as its owner made it
        cluster.kubectl("delete", "service", NAME, "-n", NS)
        # 1. The API server killed mid-reconcile (the resync recreating the Service), back
        # 2 s later.
        control.restart("kube-apiserver", signal.SIGKILL, down_s=2)
        wait_for(lambda: converged(cluster, 1), 180, "convergence after the API server")
        svc = json.loads(cluster.kubectl("get", "service", NAME, "-o", "json"))
        assert [p["port"] for p in svc["spec"]["ports"]] == [80]
        # 2. etcd killed while a role scales up.
        scale(cluster, 2)
        control.restart("etcd", signal.SIGKILL, down_s=2)
        wait_for(lambda: converged(cluster, 2), 180, "convergence after etcd")
        # 3. An expired watch: history compacted, the API server restarted (its watch cache
        # starts afresh), so the operator's resumed watches answer 410 Gone; the next spec
        # change is seen after the relist.
        restarts = watch_restarts(cluster)
        control.compact_etcd()
        control.restart("kube-apiserver")
        scale(cluster, 1)
        wait_for(lambda: converged(cluster, 1), 180, "convergence after a 410")
        assert watch_restarts(cluster) > restarts, "no watch answered 410 Gone"
        # 4. A child scaled by hand (another field manager): the operator puts its own back.
        cluster.kubectl("scale", "deployment", f"{NAME}-colocated", "--replicas=3", "-n", NS)
        wait_for(lambda: converged(cluster, 1), 180, "the hand scale repaired")
        assert operator_restarts(cluster) == [0]
    finally:
        cluster.kubectl("delete", "ipool", NAME, "--wait=false", check=False)
        wait_for(lambda: not cluster.pods(NS, f"epdserve.io/pool={NAME}"), 90, "pods to go")
        wait_for(lambda: not children(cluster, "deployments"), 60, "garbage collection")
