"""The InferencePool spec as a typed, validated value (pure: no API calls).

The CRD schema checks types, enums and minimums; :func:`parse_pool` checks what a schema
cannot say (which roles go together, which cache a role set needs) and raises
:class:`InvalidSpec` naming the field, before anything is built or applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from epdserve.operator.autoscaling import (
    AutoscalingSpec,
    RoleAutoscaling,
    parse_autoscaling,
    parse_role_autoscaling,
)
from epdserve.operator.errors import InvalidSpec
from epdserve.operator.gpu import role_gpus, validate_device, with_gpus
from epdserve.operator.quantity import parse_bytes
from epdserve.operator.source import HubSource, parse_hub_source

GROUP = "epdserve.io"
VERSION = "v1alpha1"
PLURAL = "inferencepools"
KIND = "InferencePool"

ROLES = ("colocated", "encoder", "prefill", "decode")
# role -> value of `epdserve serve --role`
SERVE_ROLE = {"colocated": "both", "encoder": "encoder", "prefill": "prefill", "decode": "decode"}
STRATEGIES = ("round-robin", "least-load", "prefix", "prefix+load")
DEFAULT_TTL_S = 3600  # stored KV blocks / encoder outputs expire after an hour by default


@dataclass(frozen=True)
class RoleSpec:
    """One role's pods."""

    replicas: int = 1
    resources: dict = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: tuple[dict, ...] = ()
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    gpus: int = 0  # nvidia.com/gpu per pod (from `gpus` or the resources)
    autoscaling: RoleAutoscaling | None = None  # None: a fixed `replicas`


@dataclass(frozen=True)
class CacheSpec:
    """Where pods share KV blocks and encoder outputs."""

    backend: str = "none"  # none | redis | sharedStorage
    redis_url: str | None = None
    redis_secret: tuple[str, str] | None = None  # (secret name, key)
    redis_managed: bool = False
    redis_image: str = "redis:7.4-alpine"
    redis_resources: dict = field(default_factory=dict)
    redis_max_memory: int | None = None  # bytes; None: derived from the memory limit
    ttl_s: int = DEFAULT_TTL_S  # expiry of stored values in Redis; 0: none
    storage_claim: str | None = None
    storage_path: str = "/cache"
    storage_max_bytes: int | None = None  # LRU cap of the cache files; None: no cap


@dataclass(frozen=True)
class RouterSpec:
    """The router Deployment and the pool's endpoint Service."""

    replicas: int = 1
    strategy: str = "prefix+load"
    image: str = ""
    resources: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    service_type: str = "ClusterIP"
    service_port: int = 80
    api_key_secret: tuple[str, str] | None = None  # (secret name, key) -> EPDSERVE_API_KEY


@dataclass(frozen=True)
class PoolSpec:
    """A validated InferencePool: everything the builders need, nothing from the API."""

    name: str
    namespace: str
    uid: str
    served_name: str
    model_pvc: tuple[str, str] | None  # (claim, path inside)
    model_path: str | None
    model_hf: HubSource | None
    image: str
    pull_policy: str
    pull_secrets: tuple[str, ...]
    tuning: dict  # serve flag (upper snake) -> value, e.g. {"MAX_MODEL_LEN": 4096}
    roles: dict  # role -> RoleSpec, only the roles present
    cache: CacheSpec
    hash_seed: str
    kv_events: bool
    router: RouterSpec
    service_monitor: dict | None  # {"interval": ..., "labels": {...}} when enabled
    network_policy: bool = True  # fence the KV-event and Redis ports to the pool's pods
    device: str = "auto"  # auto: cuda for roles with GPUs, the engine's own choice otherwise
    gpu_memory_utilization: float = 0.9
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    kv_events_curve: bool = True  # CurveZMQ on the KV-event sockets (keys in a pool Secret)

    @property
    def model_arg(self) -> str:
        """The MODEL argument of `epdserve serve` / `--model` of the router."""
        if self.model_pvc:
            claim, path = self.model_pvc
            return "/models/" + path.strip("/") if path.strip("/") else "/models"
        return self.model_path or (self.model_hf.id if self.model_hf else "")

    @property
    def disaggregated(self) -> bool:
        return "colocated" not in self.roles


def _resources(raw: dict | None) -> dict:
    """Quantities as strings, as the API server returns them (`1` -> `"1"`)."""
    return {
        kind: {name: str(q) for name, q in (values or {}).items()}
        for kind, values in (raw or {}).items()
        if kind in ("requests", "limits")
    }


def _role(raw: dict, where: str) -> RoleSpec:
    resources = _resources(raw.get("resources"))
    gpus = role_gpus(raw, resources, where)
    return RoleSpec(
        replicas=int(raw.get("replicas", 1)),
        resources=with_gpus(resources, gpus),
        gpus=gpus,
        args=tuple(raw.get("args") or ()),
        env=tuple(raw.get("env") or ()),
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=tuple(raw.get("tolerations") or ()),
        autoscaling=parse_role_autoscaling(raw.get("autoscaling"), where),
    )


def _bytes(value, where: str) -> int | None:
    """A positive byte quantity of the spec, or None when unset."""
    if value is None:
        return None
    try:
        size = parse_bytes(value)
    except ValueError as exc:
        raise InvalidSpec(f"{where}: {exc}") from None
    if size <= 0:
        raise InvalidSpec(f"{where}: must be more than 0 bytes, got {value!r}")
    return size


def _cache(raw: dict) -> CacheSpec:
    redis = raw.get("redis") or {}
    storage = raw.get("sharedStorage") or {}
    ttl = redis.get("ttlSeconds", DEFAULT_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
        raise InvalidSpec(f"spec.cache.redis.ttlSeconds: a whole number >= 0, got {ttl!r}")
    return CacheSpec(
        backend=raw.get("backend", "none"),
        redis_url=redis.get("url"),
        redis_secret=_secret_ref(
            redis.get("passwordSecretRef"), "password", "spec.cache.redis.passwordSecretRef"
        ),
        redis_managed=bool(redis.get("managed", False)),
        redis_image=redis.get("image", "redis:7.4-alpine"),
        redis_resources=_resources(redis.get("resources")),
        redis_max_memory=_bytes(redis.get("maxMemory"), "spec.cache.redis.maxMemory"),
        ttl_s=ttl,
        storage_claim=storage.get("claimName"),
        storage_path=storage.get("path", "/cache"),
        storage_max_bytes=_bytes(storage.get("maxBytes"), "spec.cache.sharedStorage.maxBytes"),
    )


def _secret_ref(raw: dict | None, default_key: str, where: str) -> tuple[str, str] | None:
    """(secret name, key) of a `{name, key}` reference, or None when unset."""
    if not raw:
        return None
    if not raw.get("name"):
        raise InvalidSpec(f"{where}.name is required")
    return raw["name"], raw.get("key") or default_key


_TUNING = {
    "dtype": "DTYPE",
    "maxModelLen": "MAX_MODEL_LEN",
    "blockSize": "BLOCK_SIZE",
    "kvCacheMemory": "KV_CACHE_MEMORY",
    "maxNumSeqs": "MAX_NUM_SEQS",
}


def parse_pool(body: dict[str, Any]) -> PoolSpec:
    """Turn an InferencePool object (as the API returns it) into a validated PoolSpec."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    model = spec.get("model") or {}
    source = model.get("source") or {}
    engine = spec.get("engine") or {}
    roles = {
        r: _role(v or {}, f"spec.roles.{r}")
        for r, v in (spec.get("roles") or {}).items()
        if r in ROLES
    }
    cache = _cache(spec.get("cache") or {})
    router = spec.get("router") or {}
    service = router.get("service") or {}
    monitor = (spec.get("metrics") or {}).get("serviceMonitor") or {}
    if not model.get("name"):
        raise InvalidSpec("spec.model.name is required")
    if not engine.get("image"):
        raise InvalidSpec("spec.engine.image is required")
    pvc = source.get("pvc")
    pool = PoolSpec(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        served_name=model["name"],
        model_pvc=(pvc["claimName"], pvc.get("path", "")) if pvc else None,
        model_path=source.get("path"),
        model_hf=parse_hub_source(source.get("huggingFace")),
        image=engine["image"],
        pull_policy=engine.get("imagePullPolicy", "IfNotPresent"),
        pull_secrets=tuple(engine.get("imagePullSecrets") or ()),
        tuning={flag: engine[key] for key, flag in _TUNING.items() if key in engine},
        roles=roles,
        cache=cache,
        hash_seed=str(spec.get("hashSeed") or meta.get("uid") or meta.get("name", "")),
        kv_events=bool((spec.get("kvEvents") or {}).get("enabled", True)),
        kv_events_curve=bool((spec.get("kvEvents") or {}).get("curve", True)),
        router=RouterSpec(
            replicas=int(router.get("replicas", 1)),
            strategy=router.get("strategy", "prefix+load"),
            image=router.get("image") or engine["image"],
            resources=_resources(router.get("resources")),
            node_selector=dict(router.get("nodeSelector") or {}),
            tolerations=tuple(router.get("tolerations") or ()),
            service_type=service.get("type", "ClusterIP"),
            service_port=int(service.get("port", 80)),
            api_key_secret=_secret_ref(
                router.get("apiKeySecretRef"), "api-key", "spec.router.apiKeySecretRef"
            ),
        ),
        service_monitor=(
            {
                "interval": monitor.get("interval", "30s"),
                "labels": dict(monitor.get("labels") or {}),
            }
            if monitor.get("enabled")
            else None
        ),
        network_policy=bool((spec.get("networkPolicy") or {}).get("enabled", True)),
        device=engine.get("device", "auto"),
        gpu_memory_utilization=float(engine.get("gpuMemoryUtilization", 0.9)),
        autoscaling=parse_autoscaling(spec.get("autoscaling")),
    )
    validate(pool)
    return pool


def validate(pool: PoolSpec) -> None:
    """Raise InvalidSpec for combinations the CRD schema cannot express."""
    sources = [s for s in (pool.model_pvc, pool.model_path, pool.model_hf) if s]
    if len(sources) != 1:
        raise InvalidSpec(
            f"spec.model.source: set exactly one of pvc, path, huggingFace (found {len(sources)})"
        )
    roles = set(pool.roles)
    if not roles:
        raise InvalidSpec("spec.roles: declare colocated, or prefill and decode (and encoder)")
    if "colocated" in roles and roles != {"colocated"}:
        raise InvalidSpec(
            "spec.roles: colocated cannot be combined with "
            + ", ".join(sorted(roles - {"colocated"}))
        )
    if "colocated" not in roles and not {"prefill", "decode"} <= roles:
        missing = sorted({"prefill", "decode"} - roles)
        raise InvalidSpec(f"spec.roles: a disaggregated pool needs {' and '.join(missing)} too")
    _validate_cache(pool)
    validate_device(pool)
    if pool.router.strategy not in STRATEGIES:
        raise InvalidSpec(f"spec.router.strategy: unknown strategy {pool.router.strategy!r}")


def _validate_cache(pool: PoolSpec) -> None:
    cache = pool.cache
    if pool.disaggregated and cache.backend == "none":
        raise InvalidSpec(
            "spec.cache.backend: a disaggregated pool moves KV blocks between pods; "
            "use redis or sharedStorage"
        )
    if cache.backend == "redis":
        if cache.redis_managed == bool(cache.redis_url):
            raise InvalidSpec("spec.cache.redis: set exactly one of url or managed: true")
        _validate_redis_url(cache.redis_url)
        if cache.redis_managed and cache.redis_secret:
            raise InvalidSpec(
                "spec.cache.redis.passwordSecretRef: the managed Redis generates its own password"
            )
        _validate_max_memory(cache)
    if cache.backend == "sharedStorage" and not cache.storage_claim:
        raise InvalidSpec("spec.cache.sharedStorage.claimName is required for sharedStorage")


def _validate_redis_url(url: str | None) -> None:
    """A password in the URL would land in the pool's ConfigMap and the pods' env: refuse it."""
    if not url:
        return
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise InvalidSpec(f"spec.cache.redis.url: not a URL ({exc})") from None
    in_query = any(k.lower() == "password" for k, _ in parse_qsl(parts.query))
    if parts.password is not None or in_query:
        raise InvalidSpec(
            "spec.cache.redis.url: carries a password, which would be copied into a ConfigMap; "
            "remove it from the URL, put it in a Secret and reference that Secret with "
            "spec.cache.redis.passwordSecretRef"
        )


def _validate_max_memory(cache: CacheSpec) -> None:
    if cache.redis_max_memory is None:
        return
    if not cache.redis_managed:
        raise InvalidSpec(
            "spec.cache.redis.maxMemory: applies to the managed Redis only; "
            "set maxmemory on the external server"
        )
    limit = (cache.redis_resources.get("limits") or {}).get("memory")
    if limit is not None and cache.redis_max_memory > _bytes(limit, "resources.limits.memory"):
        raise InvalidSpec(
            f"spec.cache.redis.maxMemory: {cache.redis_max_memory} bytes exceeds the Redis "
            f"container's memory limit ({limit}); it would be OOM-killed before evicting"
        )
