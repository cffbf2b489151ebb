"""InferencePool bodies for e2e/test_crd_api.py: a base P/D pool and the changes that make it
invalid (refused by the CRD's OpenAPI schema, or by its CEL rules) or valid at an edge.

A change is `{"dotted.path.in.spec": value}`; None deletes the field. Each refusal names the
field path the API server must report and words of its message.
"""

from __future__ import annotations

import copy

from ipool_samples import pool_body

GPU = "nvidia.com/gpu"
MANAGED = {"managed": True}
ADAPTER = {"name": "sql", "source": {"path": "/opt/adapters/sql"}}
AUTOSCALE = {"minReplicas": 1, "maxReplicas": 4, "target": 4}


def pool(name: str = "p", changes: dict | None = None) -> dict:
    """A prefill/decode pool with a managed Redis in `default`, with `changes` applied."""
    body = pool_body(name, roles={"prefill": {}, "decode": {}}, cache={"backend": "redis"})
    body["spec"]["cache"]["redis"] = dict(MANAGED)
    body["metadata"] = {"name": name, "namespace": "default"}
    for path, value in (changes or {}).items():
        *parents, key = path.split(".")
        node = body["spec"]
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(key, None)
        else:
            node[key] = copy.deepcopy(value)
    return body


def ids(cases: list[tuple]) -> list[str]:
    """Test ids: the field path each case expects in the error."""
    return [path for _, path, _ in cases]


# (changes, field path in the error, words of the error): the OpenAPI schema's own checks
REFUSED_BY_SCHEMA = [
    ({"roles.decode.replicas": "two"}, "spec.roles.decode.replicas", "must be of type integer"),
    ({"engine.image": None}, "spec.engine.image", "Required value"),
    ({"model.source.huggingFace": "Qwen/Qwen3-0.6B"}, "spec.model.source.huggingFace", "object"),
    ({"roles.decode.replica": 2}, '"spec.roles.decode.replica"', "unknown field"),
    ({"router.service.port": 70000}, "spec.router.service.port", "less than or equal to 65535"),
    ({"roles.prefill.tensorParallelSize": 65}, "spec.roles.prefill.tensorParallelSize", "64"),
    ({"roles.encoder.tensorParallelSize": 2}, "spec.roles.encoder.tensorParallelSize", "to 1"),
    ({"router.strategy": "random"}, "spec.router.strategy", 'Unsupported value: "random"'),
    ({"engine.dtype": "fp8"}, "spec.engine.dtype", 'Unsupported value: "fp8"'),
    ({"cache.redis": {"url": "redis://:pw@r:6379"}}, "spec.cache.redis.url", "should match"),
    ({"metrics.serviceMonitor.interval": "soon"}, "spec.metrics.serviceMonitor.interval", "match"),
    ({"lora.adapters": [{**ADAPTER, "name": "a b"}]}, "spec.lora.adapters[0].name", "should match"),
    ({"router.tenancy.header": "X Tenant"}, "spec.router.tenancy.header", "should match"),
]

# (changes, field path, words of the rule's message): one per CEL rule of the CRD
REFUSED_BY_CEL = [
    ({"model.source.pvc": {"claimName": "w"}}, "spec.model.source", "exactly one of pvc, path"),
    (
        {
            "model.source": {
                "huggingFace": {"id": "a/b", "cache": {"claimName": "c", "hostPath": "/h"}}
            }
        },
        "spec.model.source.huggingFace.cache",
        "at most one of claimName",
    ),
    ({"roles.colocated": {}}, "spec.roles", "colocated cannot be combined"),
    ({"roles.decode": None}, "spec.roles", "needs both prefill and decode"),
    ({"roles": {"encoder": {}}}, "spec.roles", "needs both prefill and decode"),
    ({"cache": None}, "spec.cache.backend", "set cache.backend to redis or sharedStorage"),
    ({"cache.backend": "none"}, "spec.cache.backend", "moves KV blocks between pods"),
    ({"engine.device": "cpu", "roles.decode.gpus": 1}, "spec.engine.device", "asks for GPUs"),
    (
        {"engine.device": "cpu", "roles.prefill.resources": {"limits": {GPU: 1}}},
        "spec.engine.device",
        "asks for GPUs",
    ),
    ({"lora.adapters": [{**ADAPTER, "name": "tiny"}]}, "spec.lora.adapters", "served model's name"),
    ({"lora.adapters": [ADAPTER, ADAPTER]}, "spec.lora.adapters", "names must be unique"),
    (
        {"lora.adapters": [{**ADAPTER, "source": {"path": "/a", "pvc": {"claimName": "c"}}}]},
        "spec.lora.adapters[0].source",
        "exactly one of huggingFace, pvc, path",
    ),
    (
        {"lora.adapters": [{**ADAPTER, "source": {"pvc": {"claimName": "c", "path": "a/../b"}}}]},
        "spec.lora.adapters[0].source.pvc.path",
        "without '..'",
    ),
    (
        {"roles.decode.gpus": 2, "roles.decode.resources": {"limits": {GPU: 1}}},
        "spec.roles.decode.gpus",
        "must name the same count",
    ),
    (
        {"roles.decode.resources": {"requests": {GPU: 1}, "limits": {GPU: 2}}},
        "spec.roles.decode.resources",
        "same nvidia.com/gpu count",
    ),
    (
        {"roles.prefill.tensorParallelSize": 2, "roles.prefill.gpus": 1},
        "spec.roles.prefill.gpus",
        "one rank per GPU",
    ),
    (
        {"roles.prefill.tensorParallelSize": 4, "roles.prefill.resources": {"limits": {GPU: 2}}},
        "spec.roles.prefill.gpus",
        "one rank per GPU",
    ),
    (
        {"roles.prefill.cpusPerRank": 2, "roles.prefill.resources": {"requests": {"cpu": "4"}}},
        "spec.roles.prefill.cpusPerRank",
        "leave cpu out of resources",
    ),
    ({"roles.decode.args": ["-tp", "2"]}, "spec.roles.decode.args", "set tensorParallelSize"),
    (
        {"roles.encoder": {"args": ["--tensor-parallel-size=2"]}},
        "spec.roles.encoder.args",
        "set tensorParallelSize",
    ),
    (
        {"roles.decode.env": [{"name": "EPDSERVE_TENSOR_PARALLEL_SIZE", "value": "2"}]},
        "spec.roles.decode.env",
        "set tensorParallelSize",
    ),
    ({"roles.decode.shmSize": "0"}, "spec.roles.decode.shmSize", "more than 0 bytes"),
    (
        {"roles.decode.autoscaling": {**AUTOSCALE, "minReplicas": 3, "maxReplicas": 2}},
        "spec.roles.decode.autoscaling.maxReplicas",
        "below minReplicas",
    ),
    (
        {"roles.prefill.autoscaling": {**AUTOSCALE, "target": 0}},
        "spec.roles.prefill.autoscaling.target",
        "more than 0",
    ),
    ({"cache": {"backend": "sharedStorage"}}, "spec.cache.sharedStorage", "needs sharedStorage"),
    ({"cache.redis": {}}, "spec.cache.redis", "exactly one of redis.url"),
    ({"cache.redis.url": "redis://r:6379"}, "spec.cache.redis", "exactly one of redis.url"),
    (
        {"cache.redis.passwordSecretRef": {"name": "s"}},
        "spec.cache.redis.passwordSecretRef",
        "generates its own password",
    ),
    (
        {"cache.redis": {"url": "redis://r:6379", "maxMemory": "1Gi"}},
        "spec.cache.redis.maxMemory",
        "managed Redis only",
    ),
    (
        {
            "cache.redis": {
                **MANAGED,
                "maxMemory": "2Gi",
                "resources": {"limits": {"memory": "1Gi"}},
            }
        },
        "spec.cache.redis.maxMemory",
        "exceeds the Redis container's memory limit",
    ),
    ({"cache.redis.maxMemory": 0}, "spec.cache.redis.maxMemory", "more than 0 bytes"),
    (
        {"cache.redis": {"url": "redis://r:6379/0?db=0&Password=pw"}},
        "spec.cache.redis.url",
        "carries a password",
    ),
    (
        {
            "cache": {
                "backend": "sharedStorage",
                "sharedStorage": {"claimName": "c", "maxBytes": "0"},
            }
        },
        "spec.cache.sharedStorage.maxBytes",
        "more than 0 bytes",
    ),
    ({"router.tenancy.header": "Authorization"}, "spec.router.tenancy.header", "API key"),
    (
        {"router.tenancy.queueTimeoutSeconds": 0},
        "spec.router.tenancy.queueTimeoutSeconds",
        "more than 0",
    ),
    (
        {"autoscaling.engine": "keda"},
        "spec.autoscaling.prometheusAddress",
        "needs prometheusAddress",
    ),
]

# valid at the edges of the rules: the API server and the operator both accept them
ACCEPTED = [
    {"roles.prefill": {"tensorParallelSize": 2, "gpus": 2, "resources": {"limits": {GPU: 2}}}},
    {"roles.prefill": {"tensorParallelSize": 2, "cpusPerRank": 1, "shmSize": "1Gi"}},
    {
        "roles.decode.resources": {"requests": {GPU: 1}, "limits": {GPU: "1"}},
        "roles.decode.gpus": 1,
    },
    {"engine.device": "cpu", "roles.decode.resources": {"limits": {GPU: 0, "cpu": "2"}}},
    {"roles.encoder": {"gpus": 1}, "cache.redis.ttlSeconds": 0},
    {"roles.decode.autoscaling": {**AUTOSCALE, "minReplicas": 2, "maxReplicas": 2, "target": 0.5}},
    {"cache.redis": {**MANAGED, "maxMemory": "768Mi", "resources": {"limits": {"memory": "1Gi"}}}},
    {
        "cache.redis": {
            "url": "rediss://app@r:6379/0?protocol=3",
            "passwordSecretRef": {"name": "s"},
        }
    },
    {
        "cache": {
            "backend": "sharedStorage",
            "sharedStorage": {"claimName": "c", "maxBytes": "50Gi"},
        }
    },
    {"roles": {"colocated": {"args": ["--max-num-seqs", "8"]}}, "cache": None},
    {
        "lora.adapters": [
            ADAPTER,
            {"name": "de", "source": {"pvc": {"claimName": "c", "path": "support/de..v2"}}},
            {"name": "hub", "source": {"huggingFace": {"repo": "org/adapter"}}},
        ]
    },
    {"router.tenancy": {"header": "X-Tenant", "queueTimeoutSeconds": 0.5}},
    {"autoscaling": {"engine": "keda", "prometheusAddress": "http://prometheus:9090"}},
]
