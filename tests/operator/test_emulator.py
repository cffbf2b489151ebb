"""The API emulator behaves like an API server where kopf, kubectl and clients rely on it."""

from __future__ import annotations

import json

import pytest

from epdserve.operator.kube import ApiError, Kube

CM = "/api/v1/namespaces/default/configmaps"
DEP = "/apis/apps/v1/namespaces/default/deployments"


@pytest.fixture
def kube(api):
    client = Kube()
    yield client
    client.close()


def deployment(name: str, **extra) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name}, **extra}


def test_create_stamps_server_fields_and_conflicts_on_a_duplicate(kube):
    obj = kube.request("POST", CM, body={"metadata": {"name": "a"}, "data": {"k": "v"}})
    meta = obj["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert meta["generation"] == 1 and meta["namespace"] == "default"
    with pytest.raises(ApiError) as err:
        kube.request("POST", CM, body={"metadata": {"name": "a"}})
    assert err.value.status == 409


def test_spec_changes_bump_generation_and_status_goes_through_the_subresource(kube):
    kube.request("POST", DEP, body=deployment("d", spec={"replicas": 1}))
    merge = "application/merge-patch+json"
    obj = kube.request("PATCH", f"{DEP}/d", body={"spec": {"replicas": 2}}, content_type=merge)
    assert obj["metadata"]["generation"] == 2
    obj = kube.request(
        "PATCH", f"{DEP}/d", body={"status": {"readyReplicas": 2}}, content_type=merge
    )
    assert "status" not in obj  # ignored on the main resource
    body = {"status": {"readyReplicas": 2}, "spec": {"replicas": 9}}
    obj = kube.request("PATCH", f"{DEP}/d/status", body=body, content_type=merge)
    assert obj["status"] == {"readyReplicas": 2} and obj["spec"]["replicas"] == 2
    assert obj["metadata"]["generation"] == 2


def test_stale_resource_versions_conflict_and_failed_json_patch_tests_are_422(kube):
    obj = kube.request("POST", CM, body={"metadata": {"name": "c"}, "data": {"k": "1"}})
    stale = obj["metadata"]["resourceVersion"]
    obj["data"]["k"] = "2"
    kube.request("PUT", f"{CM}/c", body=obj)
    with pytest.raises(ApiError) as err:
        kube.request("PUT", f"{CM}/c", body=obj)  # same (now stale) resourceVersion
    assert err.value.status == 409
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": stale}]
    ops.append({"op": "replace", "path": "/data/k", "value": "3"})
    with pytest.raises(ApiError) as err:
        kube.request("PATCH", f"{CM}/c", body=ops, content_type="application/json-patch+json")
    assert err.value.status == 422


def test_deleting_an_owner_collects_its_children_unless_orphaned(kube):
    owner = kube.request("POST", CM, body={"metadata": {"name": "owner"}})
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    kube.request(
        "POST", DEP, body=deployment("child", metadata={"name": "child", "ownerReferences": [ref]})
    )
    kube.delete("v1", "ConfigMap", "default", "owner")
    assert kube.get("apps/v1", "Deployment", "default", "child") is None


def test_finalizers_hold_deletion_until_removed(kube):
    kube.request("POST", CM, body={"metadata": {"name": "f", "finalizers": ["x/y"]}})
    kube.delete("v1", "ConfigMap", "default", "f")
    assert kube.get("v1", "ConfigMap", "default", "f")["metadata"]["deletionTimestamp"]
    patch = {"metadata": {"finalizers": None}}
    kube.request("PATCH", f"{CM}/f", body=patch, content_type="application/merge-patch+json")
    assert kube.get("v1", "ConfigMap", "default", "f") is None


def test_label_selectors_filter_lists(kube):
    for name, labels in (("l1", {"a": "1", "b": "x"}), ("l2", {"a": "2"}), ("l3", {})):
        kube.request("POST", CM, body={"metadata": {"name": name, "labels": labels}})

    def names(selector):
        return sorted(
            o["metadata"]["name"] for o in kube.list("v1", "ConfigMap", "default", selector)
        )

    assert names("a=1") == ["l1"]
    assert names("a!=1") == ["l2", "l3"]
    assert names("a in (1,2),!b") == ["l2"]
    assert names("a") == ["l1", "l2"]


def test_watches_resume_from_a_resource_version_and_expire_after_compaction(api, kube):
    first = kube.request("POST", CM, body={"metadata": {"name": "w1"}})
    kube.request("POST", CM, body={"metadata": {"name": "w2"}})
    since = first["metadata"]["resourceVersion"]
    events = _watch(kube, since)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "w2")]
    api.call(api.emulator.compact)
    (expired,) = _watch(kube, since)
    assert expired["type"] == "ERROR" and expired["object"]["code"] == 410


def test_injected_faults_answer_once_then_the_real_state(api, kube):
    kube.request("POST", CM, body={"metadata": {"name": "x"}})
    api.call(api.emulator.fail, "get", "v1/configmaps", 503, times=1)
    with pytest.raises(ApiError) as err:
        kube.get("v1", "ConfigMap", "default", "x")
    assert err.value.status == 503 and err.value.transient
    assert kube.get("v1", "ConfigMap", "default", "x")["metadata"]["name"] == "x"


def test_a_created_crd_becomes_a_served_resource(kube):
    import yaml
    from ipool_samples import ROOT

    crd = yaml.safe_load((ROOT / "crds" / "inferencepool.yaml").read_text())
    kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=crd)
    discovery = kube.request("GET", "/apis/epdserve.io/v1alpha1")
    names = {r["name"]: r for r in discovery["resources"]}
    assert names["inferencepools"]["shortNames"] == ["ipool"]
    assert "inferencepools/status" in names


def _watch(kube: Kube, since: str) -> list[dict]:
    """Events of a configmaps watch from `since`, read for one server-side second."""
    path = CM + f"?watch=true&resourceVersion={since}&timeoutSeconds=1"
    serialized = kube.api.param_serialize(method="GET", resource_path=path)
    raw = kube.api.call_api(*serialized, _request_timeout=10).read()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]
