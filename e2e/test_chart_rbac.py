"""The chart on the real control plane: what `helm install` put there, the operator's
ServiceAccount held to the chart's RBAC (and nothing more), a denied verb reported as the
pool's condition rather than a crash loop, and `helm upgrade --force-conflicts` restoring the
chart's Role (a plain upgrade refuses: Helm 4 applies server-side, and the hand edit owns the
rules).
"""

from __future__ import annotations

import json

import pytest
from cluster import OPERATOR_NS, wait_for
from pools_e2e import (
    MODEL_PATH,
    NS,
    OPERATOR_VALUES,
    condition,
    example,
    for_this_machine,
    write,
)

pytestmark = pytest.mark.e2e
OPERATOR = f"system:serviceaccount:{OPERATOR_NS}:epdserve-operator"


def can(cluster, verb: str, resource: str, namespace: str | None = NS) -> bool:
    where = ["-n", namespace] if namespace else []
    out = cluster.kubectl("auth", "can-i", verb, resource, f"--as={OPERATOR}", *where, check=False)
    return out.strip() == "yes"


def test_helm_installed_the_crd_rbac_and_a_running_operator(cluster):
    releases = json.loads(cluster.helm("list", "-n", OPERATOR_NS, "-o", "json"))
    assert [(r["name"], r["status"]) for r in releases] == [("epdserve", "deployed")]
    crd = json.loads(cluster.kubectl("get", "crd", "inferencepools.epdserve.io", "-o", "json"))
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established.get("Established") == "True"
    assert established.get("NonStructuralSchema") is None
    (pod,) = cluster.pods(OPERATOR_NS, "app.kubernetes.io/name=epdserve-operator")
    assert pod["spec"]["serviceAccountName"] == "epdserve-operator"
    assert pod["spec"]["securityContext"]["runAsUser"] == 65532
    assert all(s["ready"] for s in pod["status"]["containerStatuses"])


def test_the_operator_account_holds_the_charts_grants_and_nothing_more(cluster):
    # What the operator does in the namespace it manages.
    for verb, resource in [
        ("create", "deployments.apps"),
        ("patch", "deployments.apps"),
        ("create", "services"),
        ("create", "secrets"),
        ("patch", "inferencepools.epdserve.io/status"),
    ]:
        assert can(cluster, verb, resource), f"the chart should grant {verb} {resource}"
    # What it never needs: reading Secrets, other namespaces, cluster-wide writes.
    for verb, resource, namespace in [
        ("get", "secrets", NS),
        ("list", "secrets", NS),
        ("create", "deployments.apps", "kube-system"),
        ("create", "deployments.apps", OPERATOR_NS),
        ("delete", "nodes", None),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
        ("impersonate", "users", None),
    ]:
        assert not can(cluster, verb, resource, namespace), f"{verb} {resource} in {namespace}"


@pytest.mark.slow  # ~45 s (a pool degraded, then a helm upgrade): CI runs it in make test-slow
def test_a_denied_verb_is_the_pools_condition_and_helm_upgrade_restores_it(cluster, tmp_path):
    role = json.loads(cluster.kubectl("get", "role", "epdserve-operator", "-n", NS, "-o", "json"))
    assert any("services" in r.get("resources", []) for r in role["rules"])
    rules = [  # the chart's Role without Services, everything else kept
        {**r, "resources": [x for x in r.get("resources", []) if x != "services"]}
        for r in role["rules"]
    ]
    rules = [r for r in rules if r["resources"]]
    cluster.kubectl(
        "patch",
        "role",
        "epdserve-operator",
        "-n",
        NS,
        "--type=merge",
        "-p",
        json.dumps({"rules": rules}),
    )
    wait_for(lambda: not can(cluster, "create", "services"), 30, "the Role edit to apply")
    (operator,) = cluster.pods(OPERATOR_NS, "app.kubernetes.io/name=epdserve-operator")
    pool = for_this_machine(example("colocated-text"), MODEL_PATH, replicas={"colocated": 1})
    name = pool["metadata"]["name"] = "denied"
    cluster.kubectl("apply", "-f", write(tmp_path, pool))
    try:

        def degraded():
            got = json.loads(cluster.kubectl("get", "ipool", name, "-o", "json"))
            return condition(got, "Degraded").get("status") == "True" and condition(got, "Degraded")

        found = wait_for(degraded, 60, "the pool to report the denial")
        assert "403" in found["message"] and "services" in found["message"], found
        # The operator keeps running: no restart, no crash loop.
        (now,) = cluster.pods(OPERATOR_NS, "app.kubernetes.io/name=epdserve-operator")
        assert now["metadata"]["uid"] == operator["metadata"]["uid"]
        assert [s["restartCount"] for s in now["status"]["containerStatuses"]] == [0]
        # Helm 4 upgrades by server-side apply: the hand edit owns `.rules` now, so a plain
        # upgrade refuses; --force-conflicts puts the chart's Role back, and the operator's
        # resync heals the pool.
        upgrade = ["upgrade", "epdserve", str(cluster_chart()), "-n", OPERATOR_NS]
        refused = cluster.helm(*upgrade, "--reuse-values", check=False, stderr=True)
        assert "conflict" in refused and ".rules" in refused, refused
        cluster.helm(*upgrade, "--reuse-values", "--force-conflicts")
        assert can(cluster, "create", "services")
        wait_for(
            lambda: (
                cluster.service_ip(NS, name, serving=False)
                and cluster.service_ip(NS, f"{name}-colocated", serving=False)
            ),
            60,
            "the pool's Services after the upgrade",
        )
        cluster.kubectl("wait", f"ipool/{name}", "--for=condition=Ready", "--timeout=180s")
    finally:
        cluster.kubectl("delete", "ipool", name, "--wait=false", check=False)
        wait_for(lambda: not cluster.pods(NS), 60, "the pool's pods to go")


def cluster_chart():
    from cluster import ROOT

    return ROOT / "charts" / "epdserve"


def test_helm_uninstall_keeps_the_crd_and_pools_and_install_brings_the_operator_back(cluster):
    cluster.helm("uninstall", "epdserve", "-n", OPERATOR_NS, "--wait")
    gone = {
        "deployment": ("deployments", OPERATOR_NS),
        "serviceaccount": ("serviceaccounts", OPERATOR_NS),
        "role": ("roles", NS),
        "clusterrole": ("clusterroles", None),
    }
    for kind, (plural, namespace) in gone.items():
        where = ["-n", namespace] if namespace else []
        names = cluster.kubectl("get", plural, *where, "-o", "name").split()
        assert not [n for n in names if "epdserve-operator" in n], f"{kind} left: {names}"
    # Helm never deletes a chart's CRDs (they would take every pool with them).
    cluster.kubectl("get", "crd", "inferencepools.epdserve.io")
    cluster.install_operator(*OPERATOR_VALUES)

    def one_ready_operator():
        pods = cluster.pods(OPERATOR_NS, "app.kubernetes.io/name=epdserve-operator")
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        statuses = [s for p in live for s in p["status"].get("containerStatuses") or []]
        return len(live) == 1 and statuses and all(s["ready"] for s in statuses)

    wait_for(one_ready_operator, 60, "the reinstalled operator")
