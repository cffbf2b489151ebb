"""The operator driven with the real kubectl (tools/bin), as a user would drive a cluster."""

from __future__ import annotations

from k8s_cluster import NS, ROOT, wait_for


def test_kubectl_apply_wait_and_delete(cluster):
    kubectl = cluster.kubectl
    example = str(ROOT / "examples" / "colocated-text.yaml")
    out = kubectl("apply", "-f", str(ROOT / "crds"), "-f", example)  # strict field validation
    assert "inferencepool.epdserve.io/qwen-small created" in out
    wait_for(
        lambda: kubectl("get", "deployments", "-l", "epdserve.io/pool=qwen-small", "-o", "name"),
        what="deployments",
    )
    kubectl("wait", "--for=jsonpath={.status.phase}=Progressing", "ipool/qwen-small")
    # No kubelet here: the test reports the pods Running and Ready as one would.
    wait_for(lambda: cluster.make_pods_ready(NS, "qwen-small") == 3, what="three pods")
    kubectl("wait", "--timeout=60s", "--for=jsonpath={.status.phase}=Ready", "ipool/qwen-small")
    endpoint = kubectl("get", "ipool", "qwen-small", "-o", "jsonpath={.status.endpoint}")
    assert endpoint == "http://qwen-small.default.svc:80"
    header, row = kubectl("get", "ipool", "qwen-small").splitlines()  # printer columns
    assert header.split() == ["NAME", "PHASE", "READY", "ENDPOINT", "AGE"]
    assert row.split()[:4] == ["qwen-small", "Ready", "3/3", endpoint]
    kubectl("delete", "-f", example, "--timeout=60s")
    wait_for(lambda: not cluster.children(NS, "qwen-small"), what="children collected")
