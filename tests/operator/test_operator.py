"""The operator (`epdserve operator` as the chart's ServiceAccount) on the real control plane,
driven with the official `kubernetes` client: create, scale, new image, drift repair,
invalid specs, readiness and status, pruning, deletion by Kubernetes' garbage collector."""

from __future__ import annotations

from ipool_samples import example, pool_body
from k8s_cluster import GVP, NS, REDIS, condition, deployment, patch_pool, wait_for


def test_create_makes_every_child_with_an_owner_reference(cluster, make_pool):
    uid = make_pool(example("pd-redis"))["metadata"]["uid"]
    expected = {
        ("ConfigMap", "llama-pd-config"),
        ("Secret", "llama-pd-redis"),
        ("ServiceAccount", "llama-pd-router"),
        ("Role", "llama-pd-router"),
        ("RoleBinding", "llama-pd-router"),
        ("Deployment", "llama-pd-prefill"),
        ("Deployment", "llama-pd-decode"),
        ("Deployment", "llama-pd-router"),
        ("Deployment", "llama-pd-redis"),
        ("Service", "llama-pd-prefill"),
        ("Service", "llama-pd-decode"),
        ("Service", "llama-pd-redis"),
        ("Service", "llama-pd"),
    }
    children = wait_for(
        lambda: (c := cluster.children(NS, "llama-pd")) and expected <= set(c) and c,
        what="all children",
    )
    for key in expected:
        owners = children[key]["metadata"]["ownerReferences"]
        assert [o["uid"] for o in owners] == [uid], key
    dep = deployment(cluster, "llama-pd-prefill")  # typed client parses what we created
    assert dep.spec.template.spec.containers[0].command[3:5] == ["--role", "prefill"]
    status = wait_for(lambda: (cluster.pool(NS, "llama-pd").get("status") or {}).get("phase"))
    assert status == "Progressing"

    def no_monitor_warnings():  # no prometheus-operator CRDs here: skipped, with a warning
        events = cluster.core.list_namespaced_event(NS).items
        return [e for e in events if e.reason == "NoServiceMonitor"]

    (warning,) = wait_for(no_monitor_warnings, what="NoServiceMonitor event")
    assert warning.type == "Warning" and warning.involved_object.name == "llama-pd"


def test_scaling_a_role_patches_its_deployment(cluster, make_pool):
    make_pool(pool_body("scale", roles={"prefill": {}, "decode": {}}, cache=REDIS))
    wait_for(lambda: deployment(cluster, "scale-decode").spec.replicas == 1, what="decode")
    patch_pool(cluster, "scale", {"spec": {"roles": {"decode": {"replicas": 5}}}})
    wait_for(lambda: deployment(cluster, "scale-decode").spec.replicas == 5, what="scaled")
    assert deployment(cluster, "scale-prefill").spec.replicas == 1


def test_a_new_image_updates_every_deployment(cluster, make_pool):
    make_pool(pool_body("img", roles={"prefill": {}, "decode": {}}, cache=REDIS))
    names = ["img-prefill", "img-decode", "img-router"]
    wait_for(lambda: all(deployment(cluster, n) for n in names), what="deployments")
    patch_pool(cluster, "img", {"spec": {"engine": {"image": "img:2"}}})

    def images():
        return {n: deployment(cluster, n).spec.template.spec.containers[0].image for n in names}

    wait_for(lambda: set(images().values()) == {"img:2"}, what="new image")


def test_a_deployment_deleted_by_hand_comes_back(cluster, make_pool):
    make_pool(pool_body("drift"))
    old_uid = wait_for(lambda: deployment(cluster, "drift-colocated").metadata.uid)
    cluster.apps.delete_namespaced_deployment("drift-colocated", NS)
    wait_for(
        lambda: deployment(cluster, "drift-colocated").metadata.uid != old_uid, what="recreated"
    )


def test_a_deployment_edited_by_hand_is_repaired(cluster, make_pool):
    make_pool(pool_body("edit"))
    wait_for(lambda: deployment(cluster, "edit-colocated"))
    cluster.apps.patch_namespaced_deployment("edit-colocated", NS, {"spec": {"replicas": 7}})
    wait_for(lambda: deployment(cluster, "edit-colocated").spec.replicas == 1, what="repaired")


def test_an_invalid_spec_sets_a_condition_and_an_event_and_creates_nothing(cluster, make_pool):
    # The API server refuses what the CRD's CEL rules cover at create time (e2e/test_crd_api.py);
    # what they leave to the operator is stored: two CPU ranks in a one-CPU pod.
    colocated = {"replicas": 1, "tensorParallelSize": 2, "resources": {"limits": {"cpu": "1"}}}
    make_pool(pool_body("bad", roles={"colocated": colocated}))
    pool = wait_for(
        lambda: (p := cluster.pool(NS, "bad")) and condition(p, "Degraded") and p,
        what="Degraded",
    )
    degraded = condition(pool, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.roles.colocated.resources" in degraded["message"]
    assert pool["status"]["phase"] == "Degraded"
    assert cluster.children(NS, "bad") == {}

    def invalid_spec_events():
        events = cluster.core.list_namespaced_event(NS).items
        return [e for e in events if e.reason == "InvalidSpec" and e.involved_object.name == "bad"]

    (event,) = wait_for(invalid_spec_events, what="InvalidSpec event")
    assert event.type == "Warning"
    # Fixing the spec recovers the pool.
    fixed = {"colocated": {"resources": {"limits": {"cpu": "2"}}}}
    patch_pool(cluster, "bad", {"spec": {"roles": fixed}})
    wait_for(lambda: ("Deployment", "bad-colocated") in cluster.children(NS, "bad"), what="fixed")
    wait_for(lambda: condition(cluster.pool(NS, "bad"), "Degraded").get("status") == "False")


def test_a_pool_scaled_to_no_router_is_ready_without_an_endpoint_to_wait_for(cluster, make_pool):
    make_pool(pool_body("norouter", router={"replicas": 0}))

    def ready():
        cluster.make_pods_ready(NS, "norouter")
        pool = cluster.pool(NS, "norouter")
        return (pool.get("status") or {}).get("phase") == "Ready" and pool

    pool = wait_for(ready, what="Ready")
    assert pool["status"]["roles"]["router"] == {"desired": 0, "ready": 0}
    assert condition(pool, "Ready")["reason"] == "AllReplicasReady"


def test_ready_pods_make_the_pool_ready_with_counts_and_endpoint(cluster, make_pool):
    make_pool(pool_body("ready", roles={"prefill": {"replicas": 2}, "decode": {}}, cache=REDIS))

    def ready():
        # No kubelet runs the pods the ReplicaSets make: report them Running and Ready as it
        # would; the ReplicaSet and Deployment controllers carry that to the Deployments.
        cluster.make_pods_ready(NS, "ready")
        pool = cluster.pool(NS, "ready")
        return (pool.get("status") or {}).get("phase") == "Ready" and pool

    pool = wait_for(ready, what="Ready")
    status = pool["status"]
    assert status["roles"]["prefill"] == {"desired": 2, "ready": 2}
    assert status["ready"] == "5/5"
    assert status["endpoint"] == "http://ready.default.svc:80"
    assert status["observedGeneration"] == pool["metadata"]["generation"]
    assert condition(pool, "Ready")["reason"] == "AllReplicasReady"
    assert condition(pool, "Progressing")["status"] == "False"
    assert deployment(cluster, "ready-prefill").status.ready_replicas == 2  # the controller's


def test_switching_roles_prunes_the_old_deployment(cluster, make_pool):
    make_pool(pool_body("switch", cache=REDIS))
    wait_for(lambda: ("Deployment", "switch-colocated") in cluster.children(NS, "switch"))
    patch_pool(
        cluster,
        "switch",
        {"spec": {"roles": {"colocated": None, "prefill": {}, "decode": {}}}},
    )

    def switched():
        kids = cluster.children(NS, "switch")
        return ("Deployment", "switch-decode") in kids and (
            "Deployment",
            "switch-colocated",
        ) not in kids

    wait_for(switched, what="colocated pruned, P/D created")


def test_deleting_the_pool_lets_the_garbage_collector_delete_its_children(cluster, make_pool):
    make_pool(pool_body("gone", roles={"prefill": {}, "decode": {}}, cache=REDIS))
    wait_for(lambda: len(cluster.children(NS, "gone")) >= 10, what="children")
    pods = "epdserve.io/pool=gone"
    wait_for(lambda: cluster.core.list_namespaced_pod(NS, label_selector=pods).items, what="pods")
    mark = cluster.audit_mark()
    cluster.custom.delete_namespaced_custom_object(*GVP, NS, "inferencepools", "gone")
    wait_for(lambda: cluster.pool(NS, "gone") is None, what="pool gone")  # no finalizer holds it
    wait_for(lambda: cluster.children(NS, "gone") == {}, what="children gone")
    wait_for(
        lambda: not cluster.core.list_namespaced_pod(NS, label_selector=pods).items,
        what="their ReplicaSets' pods gone",
    )
    assert not cluster.audit(mark, verb="delete")  # Kubernetes' collector did it, not we


def test_the_periodic_resync_repairs_a_service_deleted_by_hand(cluster, make_pool):
    make_pool(pool_body("svc"))
    old = wait_for(lambda: cluster.core.read_namespaced_service("svc", NS).metadata.uid)
    cluster.core.delete_namespaced_service("svc", NS)  # no event wakes the operator for this
    wait_for(lambda: cluster.core.read_namespaced_service("svc", NS).metadata.uid != old)


def test_a_settled_pool_is_not_applied_again_on_later_passes(cluster, make_pool):
    # What the API server stores (its defaults added, false booleans dropped) is no drift.
    make_pool(pool_body("settled", roles={"prefill": {}, "decode": {}}, cache=REDIS))
    wait_for(lambda: (cluster.pool(NS, "settled").get("status") or {}).get("phase"))
    mark = cluster.audit_mark()
    wait_for(  # a periodic pass lists the pools: the first after `mark` has ended by the second
        lambda: len(cluster.audit(mark, verb="list", resource="inferencepools")) >= 2,
        what="two periodic resync passes",
    )
    writes = [
        (e["verb"], e["resource"], e.get("name"))
        for e in cluster.audit(mark)
        if e["verb"] in ("create", "update", "patch", "delete")
        and e["resource"] not in ("inferencepools", "events", "secrets")  # status; 409s
    ]
    assert writes == []
