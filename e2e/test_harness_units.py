"""The e2e kubelet's pure parts behave as Kubernetes documents them (no root needed)."""

from __future__ import annotations

import base64

import podspec
import pytest

POD = {
    "metadata": {"name": "p-1", "namespace": "ns", "uid": "u", "labels": {"app": "x"}},
    "spec": {"nodeName": "node"},
    "status": {"podIP": "198.18.1.7"},
}


def no_token(pod, request):
    raise AssertionError("no ServiceAccount token expected")


def lookup(kind, namespace, name):
    objects = {
        ("Secret", "ns", "s"): {"data": {"password": base64.b64encode(b"hunter2").decode()}},
        ("ConfigMap", "ns", "c"): {"data": {"seed": "42"}},
    }
    return objects.get((kind, namespace, name))


def test_expansion_replaces_defined_variables_and_keeps_the_rest():
    env = {"POD_IP": "1.2.3.4"}
    assert podspec.expand("kv@$(POD_IP):8000", env) == "kv@1.2.3.4:8000"
    assert podspec.expand("$(MISSING)-$$(POD_IP)", env) == "$(MISSING)-$(POD_IP)"


def test_env_values_see_earlier_variables_and_references_resolve():
    container = {
        "name": "c",
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "TOPIC", "value": "kv@$(POD_IP)"},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "password"}}},
            {"name": "SEED", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "seed"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        ],
    }
    env = podspec.container_env(POD, container, lookup, [], {"PATH": "/bin"})
    assert env["TOPIC"] == "kv@198.18.1.7"
    assert (env["PW"], env["SEED"], env["APP"], env["PATH"]) == ("hunter2", "42", "x", "/bin")


def test_a_missing_secret_key_is_a_config_error_naming_it():
    container = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}],
    }
    with pytest.raises(podspec.ConfigError, match="nope"):
        podspec.container_env(POD, container, lookup, [], {})


def test_service_links_name_every_service_of_the_namespace():
    svc = {
        "metadata": {"name": "my-pool"},
        "spec": {"clusterIP": "198.19.0.5", "ports": [{"name": "http", "port": 80}]},
    }
    env = podspec.service_env([svc, {"metadata": {"name": "h"}, "spec": {"clusterIP": "None"}}])
    assert env["MY_POOL_SERVICE_HOST"] == "198.19.0.5"
    assert env["MY_POOL_PORT"] == "tcp://198.19.0.5:80"
    assert not any(k.startswith("H_") for k in env)


def test_security_context_maps_to_uid_gid_and_read_only_root():
    pod = {
        **POD,
        "spec": {
            "securityContext": {
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "fsGroup": 65532,
                "runAsNonRoot": True,
            }
        },
    }
    container = {
        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}
    }
    sec = podspec.security(pod, container)
    assert (sec["uid"], sec["gid"], sec["groups"]) == (65532, 65532, [65532])
    assert sec["readOnlyRoot"] and sec["noNewPrivs"]
    with pytest.raises(podspec.ConfigError, match="runAsNonRoot"):
        podspec.security({"spec": {"securityContext": {"runAsNonRoot": True}}}, {})


def test_quantities_read_as_kubernetes_writes_them():
    sizes = {"512Mi": 512 << 20, "1Gi": 1 << 30, "1G": 10**9, "1.5Ki": 1536, "1e3": 1000}
    assert {q: podspec.quantity_bytes(q) for q in sizes} == sizes
    with pytest.raises(podspec.ConfigError, match="512MB"):
        podspec.quantity_bytes("512MB")


def test_a_memory_empty_dir_is_a_tmpfs_of_its_size_limit(tmp_path):
    def source(empty_dir):
        volume = {"name": "dshm", "emptyDir": empty_dir}
        return podspec.volume_source(POD, volume, lookup, tmp_path, no_token)

    assert source({"medium": "Memory", "sizeLimit": "512Mi"}) == {"source": None, "size": 512 << 20}
    assert source({"medium": "Memory"}) == {"source": None, "size": None}
