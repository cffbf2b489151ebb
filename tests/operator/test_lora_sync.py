"""Adapters on running pods of a dynamic pool: the reconcile's load/unload pass against the API
emulator (pods listed through the real client) and real HTTP pods (lora_stub_pod)."""

from __future__ import annotations

import base64

import pytest
from ipool_samples import pool_body
from lora_stub_pod import StubPod

from epdserve.operator import lora_sync
from epdserve.operator.kube import Kube, object_path
from epdserve.operator.spec import parse_pool

NS = "default"
ADAPTERS = [
    {"name": "sql", "source": {"path": "/opt/adapters/sql"}},
    {"name": "chat-de", "source": {"pvc": {"claimName": "adapters", "path": "de"}}},
    {"name": "hub", "source": {"huggingFace": {"repo": "org/hub-lora"}}},
]


@pytest.fixture
def kube(api):
    client = Kube()
    yield client
    client.close()


def lora_pool(dynamic: bool = True, adapters=None, **spec) -> dict:
    body = pool_body("lp", **spec)
    body["metadata"]["namespace"] = NS
    body["spec"]["lora"] = {"adapters": adapters or ADAPTERS, "dynamic": dynamic}
    return body


def add_pod(kube: Kube, name: str, port: int, ready: bool = True, role="colocated", **spec):
    """A pod of the pool as a kubelet would report it: the engine's http port, and the
    volumes and init containers `spec` gives it."""
    container = {"name": "engine", "ports": [{"name": "http", "containerPort": port}]}
    labels = {"epdserve.io/pool": "lp", "epdserve.io/role": role}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [container], **spec},
    }
    kube.create(pod)
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    status = {"status": {"podIP": "127.0.0.1", "conditions": conditions, "phase": "Running"}}
    path = object_path("v1", "Pod", NS, name) + "/status"
    kube.request("PATCH", path, body=status, content_type="application/merge-patch+json")


ALL_FILES = {
    "volumes": [{"name": "lora-pvc-0", "persistentVolumeClaim": {"claimName": "adapters"}}],
    "initContainers": [
        {
            "name": "download-lora-2",
            "command": ["epdserve", "download", "org/hub-lora", "--link", "/lora/hub"],
        }
    ],
}


def test_a_dynamic_pool_loads_what_is_missing_and_unloads_what_was_removed(kube):
    with StubPod({"old": "/opt/adapters/old", "sql": "/opt/adapters/sql"}) as pod:
        add_pod(kube, "lp-0", pod.port, **ALL_FILES)
        status = lora_sync.sync(kube, parse_pool(lora_pool()))
        assert pod.changes() == [("unload", "old"), ("load", "chat-de"), ("load", "hub")]
        assert pod.adapters == {
            "sql": "/opt/adapters/sql",
            "chat-de": "/lora-pvc/adapters/de",
            "hub": "/lora/hub",
        }
    names = [(a["name"], a["pods"]) for a in status["colocated"]["adapters"]]
    assert names == [("sql", "1/1"), ("chat-de", "1/1"), ("hub", "1/1")]
    assert status["colocated"]["errors"] == []


def test_pods_that_are_not_ready_are_left_alone(kube):
    with StubPod() as ready, StubPod() as starting:
        add_pod(kube, "lp-0", ready.port, **ALL_FILES)
        add_pod(kube, "lp-1", starting.port, ready=False, **ALL_FILES)
        status = lora_sync.sync(kube, parse_pool(lora_pool()))
        assert len(ready.changes()) == 3 and starting.calls == []
    assert {a["pods"] for a in status["colocated"]["adapters"]} == {"1/1"}


def test_adapters_are_loaded_only_where_the_pod_has_their_files(kube):
    with StubPod() as pod:
        add_pod(kube, "lp-0", pod.port)  # no adapter PVC, no adapter download
        status = lora_sync.sync(kube, parse_pool(lora_pool()))
        assert pod.changes() == [("load", "sql")]
    pods = {a["name"]: a["pods"] for a in status["colocated"]["adapters"]}
    assert pods == {"sql": "1/1", "chat-de": "0/1", "hub": "0/1"}


def test_an_adapter_whose_path_changed_is_reloaded_from_the_new_path(kube):
    with StubPod({"sql": "/opt/adapters/sql-v1"}) as pod:
        add_pod(kube, "lp-0", pod.port)
        lora_sync.sync(kube, parse_pool(lora_pool(adapters=ADAPTERS[:1])))
        assert pod.changes() == [("unload", "sql"), ("load", "sql")]
        assert pod.adapters == {"sql": "/opt/adapters/sql"}


def test_a_refused_load_is_reported_with_the_pods_message_and_retried_next_pass(kube):
    pool = parse_pool(lora_pool(adapters=ADAPTERS[:1]))
    with StubPod() as pod:
        add_pod(kube, "lp-0", pod.port)
        pod.refuse["sql"] = "adapter rank 64 is above --max-lora-rank 16"
        status = lora_sync.sync(kube, pool)
        (error,) = status["colocated"]["errors"]
        assert error == "lp-0: load sql: 400 adapter rank 64 is above --max-lora-rank 16"
        assert status["colocated"]["adapters"] == [{"name": "sql", "pods": "0/1"}]
        assert lora_sync.failing(status)
        del pod.refuse["sql"]
        again = lora_sync.sync(kube, pool)
    assert again["colocated"] == {"adapters": [{"name": "sql", "pods": "1/1"}], "errors": []}


def test_an_unreachable_pod_is_an_error_in_the_status_not_an_exception(kube):
    with StubPod() as pod:
        port = pod.port
    add_pod(kube, "lp-0", port)  # nothing listens there any more
    status = lora_sync.sync(kube, parse_pool(lora_pool(adapters=ADAPTERS[:1])))
    (error,) = status["colocated"]["errors"]
    assert error.startswith("lp-0: GET /v1/models: ") and "refused" in error.lower()


def test_the_pools_api_key_is_read_from_its_secret_and_sent(kube):
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys", "namespace": NS}}
    secret["data"] = {"api-key": base64.b64encode(b"s3cret").decode()}
    kube.create(secret)
    body = lora_pool(adapters=ADAPTERS[:1], router={"apiKeySecretRef": {"name": "keys"}})
    with StubPod(api_key="s3cret") as pod:
        add_pod(kube, "lp-0", pod.port)
        status = lora_sync.sync(kube, parse_pool(body))
        assert pod.changes() == [("load", "sql")]
    assert status["colocated"]["errors"] == []


def test_a_missing_api_key_secret_is_reported_for_every_role(kube):
    body = lora_pool(adapters=ADAPTERS[:1], router={"apiKeySecretRef": {"name": "nope"}})
    status = lora_sync.sync(kube, parse_pool(body))
    assert status["colocated"]["errors"] == ["API-key Secret nope has no key 'api-key'"]


def test_a_static_pool_reports_its_adapters_and_calls_no_pod(kube):
    with StubPod() as pod:
        add_pod(kube, "lp-0", pod.port, **ALL_FILES)
        status = lora_sync.sync(kube, parse_pool(lora_pool(dynamic=False)))
        assert pod.calls == []
    adapters = [{"name": "sql"}, {"name": "chat-de"}, {"name": "hub"}]
    assert status == {"colocated": {"adapters": adapters, "errors": []}}


def test_each_serving_role_is_synced_and_encoders_are_not(kube):
    roles = {"encoder": {}, "prefill": {}, "decode": {}}
    cache = {"backend": "redis", "redis": {"managed": True}}
    body = lora_pool(adapters=ADAPTERS[:1], roles=roles, cache=cache)
    with StubPod() as prefill, StubPod() as decode, StubPod() as encoder:
        add_pod(kube, "lp-p", prefill.port, role="prefill")
        add_pod(kube, "lp-d", decode.port, role="decode")
        add_pod(kube, "lp-e", encoder.port, role="encoder")
        status = lora_sync.sync(kube, parse_pool(body))
        assert prefill.changes() == decode.changes() == [("load", "sql")]
        assert encoder.calls == []
    assert set(status) == {"prefill", "decode"}
