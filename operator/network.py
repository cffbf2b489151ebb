"""Pure builders for the pool's NetworkPolicies: only the pool's router pods reach the engines'
KV-event/replay ports (the router is their only subscriber), only the pool's engine pods the
managed Redis; the engines' and the router's HTTP port stay open (clients, Prometheus,
probes). Ingress only: egress is left to the cluster's policy."""

from __future__ import annotations

from epdserve.operator import cache, meta
from epdserve.operator.router import router_selector
from epdserve.operator.spec import PoolSpec


def _tcp(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _policy(pool: PoolSpec, name: str, selector: dict, ingress: list[dict]) -> dict:
    return meta.stamp(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta.metadata(pool, name, "network-policy"),
            "spec": {
                "podSelector": {"matchLabels": selector},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }
    )


def engine_pods(pool: PoolSpec) -> dict:
    """The peer that selects every engine pod of the pool (all roles)."""
    return {"podSelector": {"matchLabels": {meta.POOL_LABEL: pool.name}}}


def router_pods(pool: PoolSpec) -> dict:
    """The peer that selects the pool's router pods."""
    return {"podSelector": {"matchLabels": router_selector(pool)}}


def build_engine_network_policy(pool: PoolSpec) -> dict:
    """NetworkPolicy `<pool>-engines`: the HTTP port from anywhere; the KV-event and replay
    ports from the pool's router pods only; any other port from nobody."""
    ingress = [{"ports": _tcp(meta.HTTP_PORT)}]
    if pool.kv_events:
        events = _tcp(meta.EVENTS_PORT, meta.REPLAY_PORT)
        ingress.append({"from": [router_pods(pool)], "ports": events})
    selector = {meta.POOL_LABEL: pool.name}
    return _policy(pool, meta.name_of(pool, "engines"), selector, ingress)


def build_redis_network_policy(pool: PoolSpec) -> dict:
    """NetworkPolicy `<pool>-redis`: the managed Redis port from the pool's engine pods only."""
    ingress = [{"from": [engine_pods(pool)], "ports": _tcp(cache.REDIS_PORT)}]
    selector = {meta.REDIS_LABEL: pool.name}
    return _policy(pool, meta.name_of(pool, "redis"), selector, ingress)


def build_network_policies(pool: PoolSpec) -> list[dict]:
    """The pool's NetworkPolicies (none when `spec.networkPolicy.enabled` is false)."""
    if not pool.network_policy:
        return []
    policies = [build_engine_network_policy(pool)]
    if pool.cache.backend == "redis" and pool.cache.redis_managed:
        policies.append(build_redis_network_policy(pool))
    return policies
