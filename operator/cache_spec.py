"""`spec.cache` of an InferencePool: where its pods share KV blocks and encoder outputs, as a
typed value, its parser, and the checks the CRD schema cannot express (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from epdserve.operator.errors import InvalidSpec
from epdserve.operator.spec_fields import byte_size, resources, secret_ref

DEFAULT_TTL_S = 3600  # stored KV blocks / encoder outputs expire after an hour by default


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


def parse_cache(raw: dict) -> CacheSpec:
    """The `spec.cache` block (``{}`` when absent) as a CacheSpec; field errors name the field."""
    redis = raw.get("redis") or {}
    storage = raw.get("sharedStorage") or {}
    ttl = redis.get("ttlSeconds", DEFAULT_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
        raise InvalidSpec(f"spec.cache.redis.ttlSeconds: a whole number >= 0, got {ttl!r}")
    return CacheSpec(
        backend=raw.get("backend", "none"),
        redis_url=redis.get("url"),
        redis_secret=secret_ref(
            redis.get("passwordSecretRef"), "password", "spec.cache.redis.passwordSecretRef"
        ),
        redis_managed=bool(redis.get("managed", False)),
        redis_image=redis.get("image", "redis:7.4-alpine"),
        redis_resources=resources(redis.get("resources")),
        redis_max_memory=byte_size(redis.get("maxMemory"), "spec.cache.redis.maxMemory"),
        ttl_s=ttl,
        storage_claim=storage.get("claimName"),
        storage_path=storage.get("path", "/cache"),
        storage_max_bytes=byte_size(storage.get("maxBytes"), "spec.cache.sharedStorage.maxBytes"),
    )


def validate_cache(cache: CacheSpec, disaggregated: bool) -> None:
    """Raise InvalidSpec for a cache the pool's roles cannot work with, or that is
    inconsistent in itself."""
    if disaggregated and cache.backend == "none":
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
    if limit is not None and cache.redis_max_memory > byte_size(limit, "resources.limits.memory"):
        raise InvalidSpec(
            f"spec.cache.redis.maxMemory: {cache.redis_max_memory} bytes exceeds the Redis "
            f"container's memory limit ({limit}); it would be OOM-killed before evicting"
        )
