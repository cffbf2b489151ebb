"""Pure builders for the operator-managed Redis: Secret, Deployment, Service."""

from __future__ import annotations

import base64
import secrets

from epdserve.operator import meta
from epdserve.operator.quantity import parse_bytes
from epdserve.operator.spec import PoolSpec

REDIS_PORT = 6379
DEFAULT_MAX_MEMORY = 1 << 30  # without a memory limit to derive it from
# `requirepass "<$REDIS_PASSWORD, escaped>"` on stdout, for redis-server's config on stdin
REQUIREPASS_CONFIG = (
    'printf \'requirepass "%s"\\n\' "$(printf %s "$REDIS_PASSWORD" | sed \'s/[\\\\"]/\\\\&/g\')"'
)
LIMIT_SHARE = 0.8  # of the memory limit: room for Redis' buffers and fragmentation


def max_memory(pool: PoolSpec) -> int:
    """The managed Redis' `maxmemory` in bytes: the spec's, else 80 % of the container's
    memory limit, else 1 GiB."""
    if pool.cache.redis_max_memory is not None:
        return pool.cache.redis_max_memory
    limit = (pool.cache.redis_resources.get("limits") or {}).get("memory")
    if limit is None:
        return DEFAULT_MAX_MEMORY
    return max(1, int(parse_bytes(limit) * LIMIT_SHARE))


def new_password() -> str:
    """A fresh random Redis password (the only impure helper here; kept out of the builders)."""
    return secrets.token_urlsafe(24)


def build_redis_secret(pool: PoolSpec, password: str) -> dict:
    """Secret `<pool>-redis` with key `password`; created once, never overwritten."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta.metadata(pool, meta.name_of(pool, "redis"), "redis"),
        "type": "Opaque",
        "data": {"password": base64.b64encode(password.encode()).decode()},
    }


def build_redis_deployment(pool: PoolSpec) -> dict:
    """Deployment `<pool>-redis`: a cache-only redis-server (no persistence) with a password,
    bounded by `maxmemory` and evicting least recently used keys when full."""
    name = meta.name_of(pool, "redis")
    selector = {meta.REDIS_LABEL: pool.name}
    container = {
        "name": "redis",
        "image": pool.cache.redis_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c"],
        # The password stays out of the pod spec and of every process's argv: the shell reads
        # it from the env and feeds `requirepass` to redis-server as a config file on stdin
        # (quoted, `\` and `"` escaped; printf is a shell builtin).
        "args": [
            f'{REQUIREPASS_CONFIG} | exec redis-server - --port 6379 --save "" '
            f"--appendonly no --dir /data --maxmemory {max_memory(pool)} "
            "--maxmemory-policy allkeys-lru"
        ],
        "env": [
            {
                "name": "REDIS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": name, "key": "password"}},
            }
        ],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "resources": dict(pool.cache.redis_resources),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "securityContext": meta.container_security_context(),
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
        "readinessProbe": {
            # redis-cli takes the password from REDISCLI_AUTH, not from its argv
            "exec": {"command": ["sh", "-c", 'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli ping']},
            "periodSeconds": 5,
        },
    }
    labels = {**selector, meta.ROLE_LABEL: "redis", "app.kubernetes.io/name": "epdserve"}
    labels["app.kubernetes.io/component"] = "redis"
    return meta.stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta.metadata(pool, name, "redis", "redis"),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": selector},
                "strategy": {"type": "Recreate"},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "automountServiceAccountToken": False,
                        "enableServiceLinks": False,
                        "securityContext": meta.pod_security_context(),
                        "containers": [container],
                        "volumes": [{"name": "data", "emptyDir": {}}],
                    },
                },
            },
        }
    )


def build_redis_service(pool: PoolSpec) -> dict:
    """Service `<pool>-redis` on port 6379."""
    return meta.stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta.metadata(pool, meta.name_of(pool, "redis"), "redis", "redis"),
            "spec": {
                "selector": {meta.REDIS_LABEL: pool.name},
                "ports": [
                    {"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}
                ],
            },
        }
    )
