"""The operator on the real control plane: NetworkPolicies are owned children (created,
repaired, pruned). (A Redis cap above its memory limit, once an InvalidSpec test here, is
refused by the CRD's CEL rule at create time on a real server: e2e/test_crd_api.py; the
operator's own check of it is tests/operator/test_hardening.py.)"""

from __future__ import annotations

from ipool_samples import pool_body
from k8s_cluster import NS, REDIS, patch_pool, wait_for

PD = {"prefill": {}, "decode": {}}


def policies(cluster, pool: str) -> dict[str, dict]:
    return {
        name: obj
        for (kind, name), obj in cluster.children(NS, pool).items()
        if kind == "NetworkPolicy"
    }


def test_network_policies_are_owned_children_of_the_pool(cluster, make_pool):
    uid = make_pool(pool_body("fenced", roles=PD, cache=REDIS))["metadata"]["uid"]
    found = wait_for(lambda: len(p := policies(cluster, "fenced")) == 2 and p, what="policies")
    assert set(found) == {"fenced-engines", "fenced-redis"}
    for policy in found.values():
        assert [o["uid"] for o in policy["metadata"]["ownerReferences"]] == [uid]
        assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_a_network_policy_deleted_by_hand_comes_back(cluster, make_pool):
    from kubernetes import client

    make_pool(pool_body("refenced", roles=PD, cache=REDIS))
    net = client.NetworkingV1Api(cluster.api_client)
    old = wait_for(lambda: net.read_namespaced_network_policy("refenced-redis", NS).metadata.uid)
    net.delete_namespaced_network_policy("refenced-redis", NS)  # no event wakes the operator
    wait_for(
        lambda: net.read_namespaced_network_policy("refenced-redis", NS).metadata.uid != old,
        what="policy recreated by the resync",
    )


def test_switching_network_policies_off_prunes_them(cluster, make_pool):
    make_pool(pool_body("open", cache=REDIS))
    wait_for(lambda: "open-engines" in policies(cluster, "open"), what="policy")
    patch_pool(cluster, "open", {"spec": {"networkPolicy": {"enabled": False}}})
    wait_for(lambda: not policies(cluster, "open"), what="policies pruned")
    assert ("Deployment", "open-colocated") in cluster.children(NS, "open")
