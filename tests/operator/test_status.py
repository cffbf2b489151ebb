"""Pure status aggregation and drift detection."""

from __future__ import annotations

import copy

import pytest
from ipool_samples import example

from epdserve.operator.kube import ApiError
from epdserve.operator.reconcile import drifted, is_subset
from epdserve.operator.router import endpoint_waiting
from epdserve.operator.spec import parse_pool
from epdserve.operator.status import degraded_status, is_transition, pool_status, ready_replicas

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def test_ready_replicas_count_only_pods_of_the_current_template():
    assert ready_replicas(None) == 0
    dep = {"metadata": {"generation": 2}, "status": {"readyReplicas": 3, "updatedReplicas": 2}}
    assert ready_replicas(dep) == 2
    dep["status"]["observedGeneration"] = 1  # the controller has not seen generation 2 yet
    assert ready_replicas(dep) == 0


def test_pool_is_ready_only_when_every_deployment_is():
    counts = {"prefill": {"desired": 2, "ready": 2}, "decode": {"desired": 1, "ready": 0}}
    status = pool_status(counts, "http://p.ns.svc:80", "seed", 3, None, T0)
    assert status["phase"] == "Progressing" and status["ready"] == "2/3"
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "False" and "decode 0/1" in ready["message"]
    counts["decode"]["ready"] = 1
    later = pool_status(counts, "http://p.ns.svc:80", "seed", 3, status["conditions"], T1)
    assert later["phase"] == "Ready" and later["observedGeneration"] == 3
    by_type = {c["type"]: c for c in later["conditions"]}
    assert by_type["Ready"]["lastTransitionTime"] == T1  # changed
    assert by_type["Degraded"]["lastTransitionTime"] == T0  # unchanged: time kept
    assert is_transition(status, later, "Ready") and not is_transition(status, later, "Degraded")


def test_ready_pods_behind_a_service_without_a_ready_endpoint_are_not_ready_yet():
    counts = {"colocated": {"desired": 1, "ready": 1}}
    waiting = "waiting for Service p to list a ready router endpoint"
    status = pool_status(counts, "http://p", "s", 1, None, T0, endpoint_waiting=waiting)
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert status["phase"] == "Progressing" and status["ready"] == "1/1"
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False",
        "EndpointNotReady",
        waiting,
    )


class Slices:
    """The one call endpoint_waiting makes: a LIST of the Service's EndpointSlices."""

    def __init__(self, result):
        self.result, self.asked = result, []

    def list(self, api_version, kind, namespace, selector):
        self.asked.append((api_version, kind, namespace, selector))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize(
    "slices, waits",
    [
        ([], True),  # no slice yet
        ([{"endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": False}}]}], True),
        ([{"endpoints": None}, {"endpoints": [{"addresses": ["10.0.0.5"]}]}], False),  # unset
        ([{"endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": True}}]}], False),
        (ApiError(404, "no EndpointSlices served"), False),  # nothing to wait for
        (ApiError(403, "forbidden"), False),
    ],
)
def test_the_endpoint_waits_for_a_ready_address_in_the_pool_services_slices(slices, waits):
    pool = parse_pool(example("colocated-text"))
    kube = Slices(slices)
    assert bool(endpoint_waiting(kube, pool)) is waits
    ((api_version, kind, namespace, selector),) = kube.asked
    assert (api_version, kind) == ("discovery.k8s.io/v1", "EndpointSlice")
    assert (namespace, selector) == (pool.namespace, f"kubernetes.io/service-name={pool.name}")


def test_a_failed_slice_list_is_an_api_error_to_retry():
    with pytest.raises(ApiError):
        endpoint_waiting(Slices(ApiError(503, "busy")), parse_pool(example("colocated-text")))


def test_degraded_status_keeps_the_last_known_counts():
    good = pool_status({"colocated": {"desired": 1, "ready": 1}}, "http://e", "s", 1, None, T0)
    bad = degraded_status("InvalidSpec", "spec.roles: ...", 2, good, T1)
    assert bad["phase"] == "Degraded" and bad["endpoint"] == "http://e"
    by_type = {c["type"]: c for c in bad["conditions"]}
    assert (
        by_type["Degraded"]["status"] == "True" and by_type["Degraded"]["reason"] == "InvalidSpec"
    )
    assert by_type["Ready"]["status"] == "True"  # the old pods still serve


def test_server_defaults_are_not_drift_but_hand_edits_are():
    want = {
        "metadata": {"annotations": {"epdserve.io/desired-hash": "h"}},
        "spec": {"a": [{"x": 1}]},
    }
    live = {
        "metadata": {"annotations": {"epdserve.io/desired-hash": "h"}, "uid": "u"},
        "spec": {"a": [{"x": 1, "defaulted": True}], "extra": 1},
    }
    assert not drifted(live, want)
    live["spec"]["a"][0]["x"] = 2
    assert drifted(live, want)
    assert not is_subset([1], [1, 2])  # lists must match in length
    live["spec"]["a"][0]["x"] = 1
    live["metadata"]["annotations"]["epdserve.io/desired-hash"] = "old"
    assert drifted(live, want)


def test_a_role_service_as_the_api_server_stores_it_is_not_drift():
    # A real API server drops false plain booleans (publishNotReadyAddresses) and adds its
    # defaults; a built field it drops would re-apply the Service on every resync pass.
    from ipool_samples import pool_body

    from epdserve.operator.engine import build_role_service
    from epdserve.operator.spec import parse_pool

    redis = {"backend": "redis", "redis": {"managed": True}}
    pool = parse_pool(pool_body(roles={"prefill": {}, "decode": {}}, cache=redis))
    want = build_role_service(pool, "prefill")
    stored = copy.deepcopy(want)
    stored["spec"] = {k: v for k, v in want["spec"].items() if v is not False}
    stored["spec"].update(clusterIPs=["None"], type="ClusterIP", sessionAffinity="None")
    assert not drifted(stored, want)


def test_api_paths_and_error_classes():
    from epdserve.operator.kube import ApiError, object_path

    assert object_path("v1", "Service", "ns", "a") == "/api/v1/namespaces/ns/services/a"
    assert object_path("apps/v1", "Deployment", "ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert all(ApiError(code, "").transient for code in (0, 409, 429, 500, 503))
    assert not any(ApiError(code, "").transient for code in (400, 403, 404, 422))
