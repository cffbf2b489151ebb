"""The real operator against the API emulator, with Secret reads forbidden as the chart's
default RBAC forbids them: it still creates the pool's Secrets (managed Redis password, Curve
keys) once, never reads one, and never overwrites one on later passes."""

from __future__ import annotations

import base64

import kmock
from ipool_samples import pool_body
from k8s_cluster import NS, REDIS, condition, deployment, patch_pool, wait_for
from k8s_store import status_body

SECRETS = "v1/secrets"


class SecretWatch:
    """Emulator reactions: GET (get/list/watch) on Secrets answers 403 and is counted; POSTs
    to Secrets are counted and served. `stop()` lets both fall through for later tests."""

    def __init__(self, emulator):
        self.reads = 0
        self.creates = 0
        self.active = True
        read = (kmock.method("GET"), kmock.resource(SECRETS))
        create = (kmock.method("POST"), kmock.resource(SECRETS))
        emulator[read] << self._read
        emulator[create] << self._create

    def _read(self):
        if not self.active:
            return NotImplemented  # disables this reaction: the emulator serves reads again
        self.reads += 1
        return kmock.Response(status=403, payload=status_body(403, "Forbidden"))

    def _create(self):
        if not self.active:
            return NotImplemented
        self.creates += 1
        raise NotImplementedError  # counted, then served by the emulator as usual

    def stop(self) -> None:
        self.active = False


def secret_data(cluster, pool: str, name: str) -> dict | None:
    secret = cluster.children(NS, pool).get(("Secret", name))
    return secret and {k: base64.b64decode(v) for k, v in secret["data"].items()}


def test_secrets_are_created_once_and_never_read_or_overwritten(cluster, make_pool):
    watch = cluster.server.call(SecretWatch, cluster.emulator)
    try:
        uid = make_pool(pool_body("sec", roles={"prefill": {}, "decode": {}}, cache=REDIS))
        uid = uid["metadata"]["uid"]
        wait_for(lambda: deployment(cluster, "sec-router"), what="router deployment")
        curve = wait_for(lambda: secret_data(cluster, "sec", "sec-kv-events-curve"), what="keys")
        password = wait_for(lambda: secret_data(cluster, "sec", "sec-redis"), what="password")
        assert sorted(curve) == ["client.public", "client.secret", "server.public", "server.secret"]
        secret = cluster.children(NS, "sec")[("Secret", "sec-kv-events-curve")]
        assert [o["uid"] for o in secret["metadata"]["ownerReferences"]] == [uid]
        # later passes (a spec change, then periodic resyncs) post both again and get 409
        created = watch.creates
        patch_pool(cluster, "sec", {"spec": {"router": {"replicas": 2}}})
        wait_for(lambda: deployment(cluster, "sec-router").spec.replicas == 2, what="patched")
        wait_for(lambda: watch.creates >= created + 4, what="two more passes")
        assert secret_data(cluster, "sec", "sec-kv-events-curve") == curve
        assert secret_data(cluster, "sec", "sec-redis") == password
        assert condition(cluster.pool(NS, "sec"), "Degraded").get("status") != "True"
        assert watch.reads == 0
    finally:
        watch.stop()


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


def test_without_curve_support_the_pool_is_degraded_until_curve_is_switched_off(
    cluster, make_pool, monkeypatch
):
    import zmq

    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    make_pool(pool_body("nocurve"))
    degraded = wait_for(
        lambda: (
            (c := condition(cluster.pool(NS, "nocurve"), "Degraded")).get("status") == "True" and c
        ),
        what="Degraded",
    )
    assert degraded["reason"] == "CurveUnavailable"
    assert "spec.kvEvents.curve" in degraded["message"]
    patch_pool(cluster, "nocurve", {"spec": {"kvEvents": {"curve": False}}})
    wait_for(lambda: deployment(cluster, "nocurve-colocated"), what="created without Curve")
