"""Offline validation: generated manifests against Kubernetes' schemas (kubernetes-validate,
strict, 1.30 and 1.33) and the example CRs against the CRD's openAPIV3Schema (jsonschema)."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ipool_samples import EXAMPLES, ROOT, example, example_docs, pool_body

from epdserve.operator.cache import build_redis_secret
from epdserve.operator.desired import desired_objects
from epdserve.operator.kvevents import CURVE_KEYS, build_curve_secret
from epdserve.operator.spec import parse_pool

K8S_VERSIONS = ("1.30.0", "1.33.0")
CRD = yaml.safe_load((ROOT / "crds" / "inferencepool.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def all_manifests(body: dict) -> list[dict]:
    pool = parse_pool(body)
    keys = {name: b"k" * 40 for name in CURVE_KEYS}
    return desired_objects(pool) + [build_redis_secret(pool, "pw"), build_curve_secret(pool, keys)]


def external_redis_pool() -> dict:
    """Options the examples do not use: external Redis with a Secret, a LoadBalancer,
    pull secrets, router placement, engine tuning, no KV events."""
    return pool_body(
        "ext",
        roles={"prefill": {"replicas": 0}, "decode": {"args": ["--max-num-seqs", "4"]}},
        cache={
            "backend": "redis",
            "redis": {"url": "redis://r.cache:6379/1", "passwordSecretRef": {"name": "rs"}},
        },
        engine={"image": "img:1", "imagePullSecrets": ["reg"], "kvCacheMemory": "4GiB"},
        kvEvents={"enabled": False},
        router={
            "service": {"type": "LoadBalancer", "port": 8080},
            "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
            "resources": {"limits": {"cpu": 2}},
        },
    )


def bounded_pool() -> dict:
    """Store bounds, an API key and NetworkPolicies on a managed-Redis P/D pool."""
    return pool_body(
        "bounded",
        roles={"prefill": {}, "decode": {}},
        cache={
            "backend": "redis",
            "redis": {
                "managed": True,
                "maxMemory": "768Mi",
                "ttlSeconds": 600,
                "resources": {"limits": {"memory": "1Gi"}},
            },
        },
        router={"apiKeySecretRef": {"name": "pool-keys", "key": "token"}},
        networkPolicy={"enabled": True},
    )


VARIANTS = {
    "bounded": bounded_pool,
    "colocated-text": lambda: example("colocated-text"),
    "pd-redis": lambda: example("pd-redis"),
    "epd-multimodal": lambda: example("epd-multimodal"),
    "external-redis": external_redis_pool,
    "gpu-pool": lambda: example("gpu-pool"),
    "gpu-pool-tp": lambda: example("gpu-pool/qwen-gpu-tp"),
    "cpu-tp": lambda: pool_body(
        "cputp", roles={"colocated": {"tensorParallelSize": 2, "cpusPerRank": 2}}
    ),
    "hub-host-path": lambda: pool_body(
        "hub",
        model={"name": "m", "source": {"huggingFace": {"id": "a/b", "cache": {"hostPath": "/h"}}}},
    ),
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_generated_manifest_is_valid_kubernetes(name, version):
    body = VARIANTS[name]()
    body["spec"]["roles"][next(iter(body["spec"]["roles"]))]["nodeSelector"] = {"a": "b"}
    jsonschema.Draft7Validator(SCHEMA).validate(body)
    checked = 0
    for obj in all_manifests(body):
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a custom resource: kubernetes-validate knows built-in kinds only
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 9


def test_the_validator_is_strict_enough_to_catch_a_typo():
    obj = next(o for o in all_manifests(example("pd-redis")) if o["kind"] == "Deployment")
    obj = copy.deepcopy(obj)
    obj["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_the_crd_itself_is_valid_kubernetes():
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(CRD, version, strict=True)


def test_crd_identity_columns_and_status_subresource():
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "inferencepools.epdserve.io"
    assert spec["scope"] == "Namespaced" and spec["names"]["shortNames"] == ["ipool"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Ready", "Endpoint", "Age"]


def _described(schema: dict, path: str = "spec") -> list[str]:
    missing = [] if schema.get("description") else [path]
    for key, sub in (schema.get("properties") or {}).items():
        missing += _described(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict) and schema["items"].get("type") == "object":
        missing += _described(schema["items"], f"{path}[]")
    return missing


def test_every_spec_field_is_described():
    assert _described(SCHEMA["properties"]["spec"]) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path):
    for doc in example_docs(path):
        jsonschema.Draft7Validator(SCHEMA).validate(doc)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["roles"]["colocated"].update(replicas=-1), "minimum"),
        (lambda s: s.update(router={"strategy": "random"}), "is not one of"),
        (lambda s: s.update(cache={"backend": "memcached"}), "is not one of"),
        (lambda s: s.pop("model"), "'model' is a required property"),
        (lambda s: s["engine"].pop("image"), "'image' is a required property"),
        (lambda s: s.update(router={"service": {"port": 70000}}), "maximum"),
        (lambda s: s.update(cache={"redis": {"maxMemory": "lots"}}), "does not match"),
        (lambda s: s.update(cache={"redis": {"ttlSeconds": -1}}), "minimum"),
        (lambda s: s.update(router={"apiKeySecretRef": {"key": "k"}}), "'name' is a required"),
    ],
)
def test_schema_rejects_bad_fields(mutate, message):
    body = pool_body()
    body["metadata"] = {"name": "p"}
    mutate(body["spec"])
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.Draft7Validator(SCHEMA).validate(body)
