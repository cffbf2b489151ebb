"""The whole desired state of a pool as a list of manifests (pure: spec in, dicts out)."""

from __future__ import annotations

from collections.abc import Callable

from epdserve.operator import (
    cache,
    engine,
    kvevents,
    lora,
    meta,
    network,
    prompt_key,
    router,
    scalers,
)
from epdserve.operator.spec import ROLES, PoolSpec

# Kinds the operator owns, in apply order (ConfigMap before the pods that read it, RBAC
# before the router that needs it, NetworkPolicies before the pods they fence), as
# (apiVersion, kind).
OWNED_KINDS = (
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("keda.sh/v1alpha1", "ScaledObject"),
)


def generated_secrets(pool: PoolSpec) -> list[tuple[str, Callable[[], dict]]]:
    """(name, build) of each Secret the operator generates for the pool (created once, never
    read back or overwritten); `build` draws fresh secret material each call."""
    out = []
    if pool.cache.backend == "redis" and pool.cache.redis_managed:
        build = lambda: cache.build_redis_secret(pool, cache.new_password())  # noqa: E731
        out.append((meta.name_of(pool, "redis"), build))
    if kvevents.curve_enabled(pool):
        build = lambda: kvevents.build_curve_secret(pool, kvevents.new_curve_keys())  # noqa: E731
        out.append((kvevents.curve_secret_name(pool), build))
    build = lambda: prompt_key.build_secret(pool, prompt_key.new_key())  # noqa: E731
    out.append((prompt_key.secret_name(pool), build))
    return out


def desired_objects(pool: PoolSpec, replicas: dict[str, int] | None = None) -> list[dict]:
    """Every child of the pool except the generated Secrets, in apply order.

    `replicas` overrides the size of autoscaled roles (what the autoscaler decided).
    """
    config_map = engine.build_config_map(pool)
    # a dynamic pool's adapter list reaches running pods through the API, not a rollout
    hashed = {k: v for k, v in config_map["data"].items() if k != lora.CONFIG_KEY}
    config_hash = meta.digest(hashed)
    objects = [
        config_map,
        router.build_router_service_account(pool),
        router.build_router_role(pool),
        router.build_router_role_binding(pool),
        *network.build_network_policies(pool),
    ]
    if pool.cache.backend == "redis" and pool.cache.redis_managed:
        objects += [cache.build_redis_service(pool), cache.build_redis_deployment(pool)]
    for role in ROLES:
        if role in pool.roles:
            objects.append(engine.build_role_service(pool, role))
            deployment = engine.build_engine_deployment(pool, role, config_hash)
            if replicas and role in replicas:
                deployment["spec"]["replicas"] = replicas[role]
                meta.stamp(deployment)  # the hash covers the size
            objects.append(deployment)
    objects += [router.build_router_deployment(pool), router.build_router_service(pool)]
    if (monitor := router.build_service_monitor(pool)) is not None:
        objects.append(monitor)
    objects += scalers.build_scalers(pool)  # after the Deployments they scale
    return objects


def desired_replicas(
    pool: PoolSpec, replicas: dict[str, int] | None = None
) -> dict[str, tuple[str, int]]:
    """Status key -> (Deployment name, desired replicas) for every Deployment of the pool."""
    sizes = {role: spec.replicas for role, spec in pool.roles.items()} | (replicas or {})
    out = {role: (meta.name_of(pool, role), sizes[role]) for role in pool.roles}
    out["router"] = (meta.name_of(pool, "router"), pool.router.replicas)
    if pool.cache.backend == "redis" and pool.cache.redis_managed:
        out["redis"] = (meta.name_of(pool, "redis"), 1)
    return out
