"""One reconcile pass: validate, apply the desired children idempotently, prune, report.

Handlers call :func:`reconcile`; it never raises for a bad spec or an API error, it returns an
:class:`Outcome` whose `status` the handler writes and whose `retry` says whether the failure
is worth retrying (TemporaryError) or needs a spec change (PermanentError).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.operator import cache, meta, router
from epdserve.operator.desired import OWNED_KINDS, desired_objects, desired_replicas
from epdserve.operator.kube import ApiError, Kube
from epdserve.operator.spec import InvalidSpec, PoolSpec, parse_pool
from epdserve.operator.status import counts_for, degraded_status, is_transition, pool_status

PRUNED_KINDS = OWNED_KINDS + (("v1", "Secret"),)


@dataclass
class Outcome:
    """What a reconcile pass found: the status to write, events to post, and any failure."""

    status: dict
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    changed: list[str] = field(default_factory=list)  # "created Deployment x", ...
    retry: str | None = None  # None | "temporary" | "permanent"
    error: str = ""


def drifted(live: dict, desired: dict) -> bool:
    """Whether the live object differs from what we want (new spec, or edited by hand)."""
    want = desired["metadata"].get("annotations", {}).get(meta.HASH_ANNOTATION)
    have = (live.get("metadata") or {}).get("annotations", {}).get(meta.HASH_ANNOTATION)
    if want != have:
        return True
    return any(
        not is_subset(value, live.get(key))
        for key, value in desired.items()
        if key not in ("metadata", "status", "apiVersion", "kind")
    )


def is_subset(want, have) -> bool:
    """`want` is contained in `have` (the server may add defaults, never remove our fields)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(is_subset(w, h) for w, h in zip(want, have, strict=True))
        )
    return want == have


def apply_object(kube: Kube, obj: dict) -> str:
    """Create or server-side-apply one child; returns created/updated/unchanged/unsupported."""
    m = obj["metadata"]
    live = kube.get(obj["apiVersion"], obj["kind"], m["namespace"], m["name"])
    if live is None:
        try:
            kube.create(obj)
            return "created"
        except ApiError as exc:
            if exc.status == 404 and obj["kind"] == "ServiceMonitor":
                return "unsupported"  # prometheus-operator's CRDs are not installed
            if exc.status != 409:  # 409: someone created it meanwhile; fall through to apply
                raise
    elif not drifted(live, obj):
        return "unchanged"
    kube.apply(obj)
    return "updated"


def ensure_secret(kube: Kube, pool: PoolSpec) -> str:
    """Create the managed Redis password Secret once; an existing one is kept as is."""
    name = meta.name_of(pool, "redis")
    if kube.get("v1", "Secret", pool.namespace, name) is not None:
        return "unchanged"
    try:
        kube.create(cache.build_redis_secret(pool, cache.new_password()))
    except ApiError as exc:
        if exc.status != 409:
            raise
        return "unchanged"
    return "created"


def prune(kube: Kube, pool: PoolSpec, keep: set[tuple[str, str]]) -> list[str]:
    """Delete children of this pool (by label and owner UID) that are no longer desired."""
    selector = f"{meta.POOL_LABEL}={pool.name},app.kubernetes.io/managed-by={meta.MANAGED_BY}"
    deleted = []
    for api_version, kind in PRUNED_KINDS:
        try:
            items = kube.list(api_version, kind, pool.namespace, selector)
        except ApiError as exc:
            if exc.status == 404:  # e.g. no ServiceMonitor CRD
                continue
            raise
        for item in items:
            m = item.get("metadata") or {}
            owners = {o.get("uid") for o in m.get("ownerReferences") or []}
            if (kind, m.get("name")) not in keep and pool.uid in owners:
                kube.delete(api_version, kind, pool.namespace, m["name"])
                deleted.append(f"deleted {kind} {m['name']}")
    return deleted


def reconcile(kube: Kube, body: dict, now: str, announce: bool = True) -> Outcome:
    """Bring the pool's children to the desired state and compute its status.

    `announce` is False for the periodic resync: only condition transitions make Events then.
    """
    old_status = dict(body.get("status") or {})
    generation = (body.get("metadata") or {}).get("generation")
    try:
        pool = parse_pool(body)
    except InvalidSpec as exc:
        return _degraded("InvalidSpec", str(exc), generation, old_status, now, "permanent")
    objects = desired_objects(pool)
    outcome = Outcome(status={})
    try:
        if pool.cache.backend == "redis" and pool.cache.redis_managed:
            if ensure_secret(kube, pool) == "created":
                outcome.changed.append(f"created Secret {meta.name_of(pool, 'redis')}")
        for obj in objects:
            result = apply_object(kube, obj)
            if result in ("created", "updated"):
                outcome.changed.append(f"{result} {obj['kind']} {obj['metadata']['name']}")
            elif result == "unsupported" and announce:
                msg = "metrics.serviceMonitor is enabled but the ServiceMonitor CRD is missing"
                outcome.events.append(("Warning", "NoServiceMonitorCRD", msg))
        keep = {(o["kind"], o["metadata"]["name"]) for o in objects}
        if pool.cache.backend == "redis" and pool.cache.redis_managed:
            keep.add(("Secret", meta.name_of(pool, "redis")))
        outcome.changed += prune(kube, pool, keep)
        replicas = desired_replicas(pool)
        live = {
            name: kube.get("apps/v1", "Deployment", pool.namespace, name)
            for name, _ in replicas.values()
        }
    except ApiError as exc:
        if exc.transient:
            return Outcome(status={}, retry="temporary", error=str(exc))
        return _degraded("ApplyFailed", str(exc), generation, old_status, now, "permanent")
    status = pool_status(
        counts_for(replicas, live),
        router.endpoint_url(pool),
        pool.hash_seed,
        generation,
        old_status.get("conditions"),
        now,
    )
    outcome.status = status
    if is_transition(old_status, status, "Ready") and status["phase"] == "Ready":
        outcome.events.append(("Normal", "Ready", f"all pods ready; endpoint {status['endpoint']}"))
    return outcome


def _degraded(reason: str, message: str, generation, old_status: dict, now: str, retry: str):
    status = degraded_status(reason, message, generation, old_status, now)
    events = [("Warning", reason, message)] if is_transition(old_status, status, "Degraded") else []
    return Outcome(status=status, events=events, retry=retry, error=message)
