"""What a real API server cannot be made to do on cue, on the API emulator (the operator runs
in this process): 409 conflicts, 5xx, cut and expired watches, a refused object; and a
libzmq without CURVE (patched in this process)."""

from __future__ import annotations

from ipool_samples import pool_body
from k8s_cluster import NS, REDIS, condition, deployment, patch_pool, wait_for

DEPLOYMENTS = "apps/v1/deployments"
POOLS = "epdserve.io/v1alpha1/inferencepools"


def test_conflicts_on_create_and_apply_are_retried(emulated_cluster, make_emulated_pool):
    em = emulated_cluster.server
    em.call(em.emulator.fail, "post", DEPLOYMENTS, 409, times=2)
    make_emulated_pool(pool_body("conflict", roles={"prefill": {}, "decode": {}}, cache=REDIS))
    wait_for(lambda: deployment(emulated_cluster, "conflict-router"), what="created despite 409s")
    em.call(em.emulator.fail, "patch", DEPLOYMENTS, 409, times=3)
    patch_pool(emulated_cluster, "conflict", {"spec": {"roles": {"prefill": {"replicas": 3}}}})
    wait_for(
        lambda: deployment(emulated_cluster, "conflict-prefill").spec.replicas == 3, what="scaled"
    )


def test_server_errors_are_retried(emulated_cluster, make_emulated_pool):
    em = emulated_cluster.server
    em.call(em.emulator.fail, "get", "v1/configmaps", 500, times=3)
    em.call(em.emulator.fail, "post", "v1/services", 503, times=2)
    make_emulated_pool(pool_body("flaky"))
    wait_for(
        lambda: ("Service", "flaky") in emulated_cluster.children(NS, "flaky"), what="endpoint svc"
    )
    wait_for(lambda: deployment(emulated_cluster, "flaky-colocated"), what="engine deployment")
    # The operator's own status writes fail too, and are retried.
    em.call(em.emulator.fail, "patch", POOLS, 500, times=2, subresource="status")
    patch_pool(emulated_cluster, "flaky", {"spec": {"router": {"replicas": 2}}})
    wait_for(lambda: deployment(emulated_cluster, "flaky-router").spec.replicas == 2, what="router")
    wait_for(
        lambda: emulated_cluster.pool(NS, "flaky")["status"].get("observedGeneration") == 2,
        what="status written for generation 2",
    )


def test_cut_watches_are_resumed(emulated_cluster, make_emulated_pool):
    make_emulated_pool(pool_body("cut"))
    wait_for(lambda: deployment(emulated_cluster, "cut-colocated"), what="created")
    em = emulated_cluster.server
    em.call(em.emulator.cut_watches)
    em.call(em.emulator.fail, "get", POOLS, 500, times=2, watch=True)  # reconnects fail twice
    patch_pool(emulated_cluster, "cut", {"spec": {"roles": {"colocated": {"replicas": 4}}}})
    wait_for(lambda: deployment(emulated_cluster, "cut-colocated").spec.replicas == 4, what="seen")


def test_expired_watches_relist(emulated_cluster, make_emulated_pool):
    make_emulated_pool(pool_body("gone410"))
    wait_for(lambda: deployment(emulated_cluster, "gone410-colocated"), what="created")
    em = emulated_cluster.server
    em.call(em.emulator.compact)  # resuming from an old resourceVersion now answers 410
    patch_pool(emulated_cluster, "gone410", {"spec": {"engine": {"image": "img:410"}}})

    def image():
        return (
            deployment(emulated_cluster, "gone410-colocated").spec.template.spec.containers[0].image
        )

    wait_for(lambda: image() == "img:410", what="change seen after 410")


def test_a_rejected_object_degrades_the_pool_until_the_cluster_accepts_it(
    emulated_cluster, make_emulated_pool
):
    em = emulated_cluster.server
    # e.g. an admission policy; rejected on three passes so the Degraded state outlives a poll
    em.call(em.emulator.fail, "post", "v1/configmaps", 403, times=3)
    make_emulated_pool(pool_body("rejected"))
    degraded = wait_for(
        lambda: (
            condition(emulated_cluster.pool(NS, "rejected"), "Degraded").get("reason")
            == "ApplyFailed"
        ),
        what="Degraded/ApplyFailed",
    )
    assert degraded
    # The resync loop keeps trying; once the object is accepted the pool recovers.
    wait_for(
        lambda: deployment(emulated_cluster, "rejected-colocated"), what="created on a later pass"
    )
    wait_for(
        lambda: (
            condition(emulated_cluster.pool(NS, "rejected"), "Degraded").get("status") == "False"
        ),
        what="Degraded cleared",
    )


def test_without_curve_support_the_pool_is_degraded_until_curve_is_switched_off(
    emulated_cluster, make_emulated_pool, monkeypatch
):
    import zmq

    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    make_emulated_pool(pool_body("nocurve"))
    degraded = wait_for(
        lambda: (
            (c := condition(emulated_cluster.pool(NS, "nocurve"), "Degraded")).get("status")
            == "True"
            and c
        ),
        what="Degraded",
    )
    assert degraded["reason"] == "CurveUnavailable"
    assert "spec.kvEvents.curve" in degraded["message"]
    patch_pool(emulated_cluster, "nocurve", {"spec": {"kvEvents": {"curve": False}}})
    wait_for(
        lambda: deployment(emulated_cluster, "nocurve-colocated"), what="created without Curve"
    )
