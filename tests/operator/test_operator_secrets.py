"""The operator on the real control plane, holding the chart's default RBAC, which lets it
create Secrets and read none: it creates the pool's Secrets (managed Redis password, Curve
keys) once, never reads one, and never overwrites one on later passes. The API server's
audit log shows what it asked for."""

from __future__ import annotations

import base64

from ipool_samples import pool_body
from k8s_cluster import NS, REDIS, condition, deployment, patch_pool, wait_for

OWN = ("sec-redis", "sec-kv-events-curve")


def secret_data(cluster, pool: str, name: str) -> dict | None:
    secret = cluster.children(NS, pool).get(("Secret", name))
    return secret and {k: base64.b64decode(v) for k, v in secret["data"].items()}


def test_secrets_are_created_once_and_never_read_or_overwritten(cluster, make_pool):
    mark = cluster.audit_mark()
    uid = make_pool(pool_body("sec", roles={"prefill": {}, "decode": {}}, cache=REDIS))
    uid = uid["metadata"]["uid"]
    wait_for(lambda: deployment(cluster, "sec-router"), what="router deployment")
    curve = wait_for(lambda: secret_data(cluster, "sec", "sec-kv-events-curve"), what="keys")
    password = wait_for(lambda: secret_data(cluster, "sec", "sec-redis"), what="password")
    assert sorted(curve) == ["client.public", "client.secret", "server.public", "server.secret"]
    secrets = {n: cluster.children(NS, "sec")[("Secret", n)]["metadata"] for n in OWN}
    assert [o["uid"] for o in secrets["sec-kv-events-curve"]["ownerReferences"]] == [uid]

    def creates(code: int) -> int:
        posts = cluster.audit(mark, verb="create", resource="secrets", code=code)
        return sum(e.get("name") in OWN for e in posts)

    wait_for(lambda: creates(201) == 2, what="both created")  # audit lines trail responses
    # later passes (a spec change, then periodic resyncs) post both again and get 409
    refused = creates(409)
    patch_pool(cluster, "sec", {"spec": {"router": {"replicas": 2}}})
    wait_for(lambda: deployment(cluster, "sec-router").spec.replicas == 2, what="patched")
    wait_for(lambda: creates(409) >= refused + 4, what="two more passes")
    assert secret_data(cluster, "sec", "sec-kv-events-curve") == curve
    assert secret_data(cluster, "sec", "sec-redis") == password
    for name, meta in secrets.items():
        now = cluster.children(NS, "sec")[("Secret", name)]["metadata"]
        assert now["resourceVersion"] == meta["resourceVersion"], f"{name} was written again"
    assert condition(cluster.pool(NS, "sec"), "Degraded").get("status") != "True"
    reads = [e for e in cluster.audit(mark, resource="secrets") if e["verb"] != "create"]
    assert reads == []


def test_a_curve_secret_deleted_by_hand_is_made_again_with_new_keys(cluster, make_pool):
    make_pool(pool_body("rekey"))
    old = wait_for(lambda: secret_data(cluster, "rekey", "rekey-kv-events-curve"), what="keys")
    cluster.core.delete_namespaced_secret("rekey-kv-events-curve", NS)
    new = wait_for(
        lambda: (d := secret_data(cluster, "rekey", "rekey-kv-events-curve")) and d != old and d,
        what="new keys",
    )
    assert sorted(new) == sorted(old)


def test_curve_switched_off_makes_no_key_secret(cluster, make_pool):
    make_pool(pool_body("plain", kvEvents={"curve": False}))
    wait_for(lambda: deployment(cluster, "plain-router"), what="router deployment")
    children = wait_for(lambda: cluster.children(NS, "plain"), what="children")
    secrets = [name for kind, name in children if kind == "Secret"]
    assert secrets == ["plain-processed-prompt-key"]  # the only one a curve-less pool gets
