"""Names, labels, owner references and security defaults shared by every builder (pure)."""

from __future__ import annotations

import hashlib
import json

from epdserve.operator.spec import GROUP, KIND, VERSION, PoolSpec

POOL_LABEL = "epdserve.io/pool"
ROLE_LABEL = "epdserve.io/role"
ROUTER_LABEL = "epdserve.io/router"
REDIS_LABEL = "epdserve.io/redis"
MANAGED_BY = "epdserve-operator"
HASH_ANNOTATION = "epdserve.io/desired-hash"
CONFIG_HASH_ANNOTATION = "epdserve.io/config-hash"

HTTP_PORT = 8000
EVENTS_PORT = 5557
REPLAY_PORT = 5558
RUN_AS = 65532  # the conventional "nonroot" uid/gid


def name_of(pool: PoolSpec, suffix: str) -> str:
    """Child object name: `<pool>-<suffix>` (the endpoint Service is just `<pool>`)."""
    return f"{pool.name}-{suffix}" if suffix else pool.name


def labels(pool: PoolSpec, component: str, role: str | None = None) -> dict[str, str]:
    """Labels on every child object; `epdserve.io/pool` lets the operator find its children."""
    out = {
        "app.kubernetes.io/name": "epdserve",
        "app.kubernetes.io/instance": pool.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        POOL_LABEL: pool.name,
    }
    if role:
        out[ROLE_LABEL] = role
    return out


def owner_reference(pool: PoolSpec) -> dict:
    """The pool as controller owner: deleting the pool garbage-collects the child."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": pool.name,
        "uid": pool.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(pool: PoolSpec, name: str, component: str, role: str | None = None) -> dict:
    """Standard child metadata: name, namespace, labels, owner reference."""
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": labels(pool, component, role),
        "ownerReferences": [owner_reference(pool)],
    }


def digest(value) -> str:
    """A short stable hash of a JSON-able value (canonical key order)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamp(obj: dict) -> dict:
    """Record the hash of the desired object, so drift and spec changes are cheap to detect."""
    annotations = obj["metadata"].setdefault("annotations", {})
    annotations.pop(HASH_ANNOTATION, None)
    annotations[HASH_ANNOTATION] = digest(obj)
    return obj


def pod_security_context() -> dict:
    """Non-root pods with a RuntimeDefault seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict:
    """Read-only root filesystem, no privilege escalation, every capability dropped."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }


def http_probe(path: str, period: int, failures: int, initial: int = 0) -> dict:
    """An HTTP GET probe on the named `http` port."""
    probe = {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }
    if initial:
        probe["initialDelaySeconds"] = initial
    return probe
