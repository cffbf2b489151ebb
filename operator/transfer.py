"""What each role's connectors are told (pure): `--kv-transfer-config`, `--ec-transfer-config`
and the KV-events config, with the cache bounds of the spec (Redis TTL, shared-volume cap)."""

from __future__ import annotations

from epdserve.operator import meta
from epdserve.operator.spec import PoolSpec

# role -> kv_role / ec_role of the connectors (None: the role does not use that connector)
KV_ROLE = {"colocated": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
# the prefill pod stores the images it encodes itself (no encoder pod, or the encoder leg
# was skipped): the decode pod gets a processed prompt naming them, never the images
EC_ROLE = {"encoder": "ec_producer", "prefill": "ec_both", "decode": "ec_consumer"}
CONNECTORS = {
    "redis": ("RedisConnector", "RedisECConnector"),
    "sharedStorage": ("SharedStorageConnector", "SharedStorageECConnector"),
}


def redis_url(pool: PoolSpec) -> str:
    """The Redis URL the connectors use (the password is merged in from the env)."""
    if pool.cache.redis_managed:
        return f"redis://{meta.name_of(pool, 'redis')}.{pool.namespace}.svc:6379/0"
    return pool.cache.redis_url or ""


EC_SHARE = 0.25  # of sharedStorage.maxBytes for encoder outputs, when the pool has encoders
# without encoder pods, only a prefill pod stores the images it encoded, for its decode pod
# (a recompute after a missed KV load, or a span in the prompt's last partial block)
EC_SHARE_PD = 1 / 16


def moves_encoder_outputs(pool: PoolSpec) -> bool:
    """Pools with encoder or prefill/decode pods pass image outputs through the store."""
    return "encoder" in pool.roles or "prefill" in pool.roles


def storage_cap(pool: PoolSpec, kind: str) -> int | None:
    """Byte cap of the `kind` ("kv" or "ec") directory on the shared volume: the whole
    `maxBytes` for KV blocks of colocated pools; else split with encoder outputs, 3:1 when
    the pool has encoder pods and 15:1 when it has only prefill/decode pods."""
    total = pool.cache.storage_max_bytes
    if total is None:
        return None
    if not moves_encoder_outputs(pool):
        return total
    share = EC_SHARE if "encoder" in pool.roles else EC_SHARE_PD
    ec = max(1, int(total * share))
    return ec if kind == "ec" else max(1, total - ec)


def _extra_config(pool: PoolSpec, kind: str = "kv") -> dict:
    """The store options of the pool's `kind` store (connector extra config)."""
    # the pool name keys every stored block (epd:kv:{pool}:...), so pools never mix
    if pool.cache.backend == "redis":
        extra = {"url": redis_url(pool), "pool": pool.name}
        if pool.cache.ttl_s:
            extra["ttl_s"] = pool.cache.ttl_s
        return extra
    extra = {"path": pool.cache.storage_path.rstrip("/") + "/" + kind, "pool": pool.name}
    if (cap := storage_cap(pool, kind)) is not None:
        extra["max_bytes"] = cap
    return extra


def kv_transfer_config(pool: PoolSpec, role: str) -> dict | None:
    """`--kv-transfer-config` of a role, or None when the role moves no KV blocks."""
    if pool.cache.backend == "none" or role not in KV_ROLE:
        return None
    return {
        "kv_connector": CONNECTORS[pool.cache.backend][0],
        "kv_role": KV_ROLE[role],
        "kv_connector_extra_config": _extra_config(pool),
    }


def ec_transfer_config(pool: PoolSpec, role: str) -> dict | None:
    """`--ec-transfer-config` of a role; disaggregated pools move encoder outputs."""
    if pool.cache.backend == "none" or not moves_encoder_outputs(pool) or role not in EC_ROLE:
        return None
    return {
        "ec_connector": CONNECTORS[pool.cache.backend][1],
        "ec_role": EC_ROLE[role],
        "ec_connector_extra_config": _extra_config(pool, "ec"),
    }


def kv_events_config(pool: PoolSpec) -> dict:
    """vLLM's KV-events config; the topic names the pod by IP (expanded by the kubelet)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{meta.EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{meta.REPLAY_PORT}",
        "topic": f"kv@$(POD_IP):{meta.HTTP_PORT}@{pool.served_name}",
    }
