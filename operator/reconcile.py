"""One reconcile pass: validate, apply the desired children idempotently, prune, report.

Handlers call :func:`reconcile`; it never raises for a bad spec or an API error, it returns an
:class:`Outcome` whose `status` the handler writes and whose `retry` says whether the failure
is worth retrying (TemporaryError) or needs a spec change (PermanentError).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.operator import lora_sync, meta, router
from epdserve.operator.autoscaler import held_replicas
from epdserve.operator.desired import (
    OWNED_KINDS,
    desired_objects,
    desired_replicas,
    generated_secrets,
)
from epdserve.operator.kube import ApiError, Kube
from epdserve.operator.kvevents import CurveUnavailable
from epdserve.operator.spec import InvalidSpec, PoolSpec, parse_pool
from epdserve.operator.status import counts_for, degraded_status, is_transition, pool_status

# Secrets are not listed: the operator may create them but not read them (docs/security.md),
# so a generated Secret a pool stops using stays until the pool is deleted (owner reference).
PRUNED_KINDS = OWNED_KINDS


@dataclass
class Outcome:
    """What a reconcile pass found: the status to write, events to post, and any failure."""

    status: dict
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    changed: list[str] = field(default_factory=list)  # "created Deployment x", ...
    retry: str | None = None  # None | "temporary" | "permanent"
    error: str = ""
    recheck: bool = False  # look again soon: what Ready waits for has no event of its own


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


def apply_object(kube: Kube, obj: dict, live: dict | None) -> str:
    """Create or server-side-apply one child given its live state (None: absent).

    Returns created / updated / unchanged.
    """
    if live is None:
        try:
            kube.create(obj)
            return "created"
        except ApiError as exc:
            if exc.status != 409:  # 409: it exists after all (e.g. labels edited away)
                raise
        check_owned(kube, obj)
    elif not drifted(live, obj):
        return "unchanged"
    kube.apply(obj)
    return "updated"


class ForeignObject(Exception):
    """An object of a child's name exists and belongs to someone else: taking it over
    (server-side apply merges into it) would mix its fields into ours, so the pool waits."""


def check_owned(kube: Kube, obj: dict) -> None:
    """After a create answered 409: go on only if the existing object is this pool's child
    (its labels edited away); raise ForeignObject otherwise."""
    meta = obj["metadata"]
    live = kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) or {}
    ours = {o.get("uid") for o in meta.get("ownerReferences") or []}
    theirs = {o.get("uid") for o in (live.get("metadata") or {}).get("ownerReferences") or []}
    if not live or ours & theirs:
        return
    raise ForeignObject(
        f"{obj['kind']} {meta['namespace']}/{meta['name']} already exists and is not "
        "this pool's: delete or rename it (the pool creates its own)"
    )


def list_children(kube: Kube, pool: PoolSpec) -> tuple[dict, set[str]]:
    """Live children by (kind, name), with one LIST per kind; and the kinds not served."""
    selector = f"{meta.POOL_LABEL}={pool.name},app.kubernetes.io/managed-by={meta.MANAGED_BY}"
    live, unserved = {}, set()
    for api_version, kind in PRUNED_KINDS:
        try:
            items = kube.list(api_version, kind, pool.namespace, selector)
        except ApiError as exc:
            if exc.status != 404:
                raise
            unserved.add(kind)  # e.g. no ServiceMonitor CRD in this cluster
            continue
        for item in items:
            live[kind, item["metadata"]["name"]] = {"apiVersion": api_version, **item}
    return live, unserved


def prune(kube: Kube, pool: PoolSpec, live: dict, keep: set[tuple[str, str]]) -> list[str]:
    """Delete children of this pool (by label and owner UID) that are no longer desired."""
    deleted = []
    for (kind, name), item in live.items():
        owners = {o.get("uid") for o in item["metadata"].get("ownerReferences") or []}
        if (kind, name) not in keep and pool.uid in owners:
            kube.delete(item["apiVersion"], kind, pool.namespace, name)
            deleted.append(f"deleted {kind} {name}")
    return deleted


def reconcile(kube: Kube, body: dict, now: str, announce: bool = True) -> Outcome:
    """Bring the pool's children to the desired state and compute its status.

    `announce` is False for the periodic resync, which may see a stale status: it posts only
    the Ready event, so a warning is posted once, by the create/update handler.
    """
    old_status = dict(body.get("status") or {})
    generation = (body.get("metadata") or {}).get("generation")
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return Outcome(status={})  # being deleted: the garbage collector takes the children
    try:
        pool = parse_pool(body)
    except InvalidSpec as exc:
        return _degraded("InvalidSpec", str(exc), generation, old_status, now, announce)
    outcome = Outcome(status={})
    try:
        live, unserved = list_children(kube, pool)
        held = held_replicas(pool, live)  # autoscaled roles keep the autoscaler's size
        _apply_all(kube, pool, live, unserved, outcome, announce, held)
    except ApiError as exc:
        if exc.transient:
            return Outcome(status={}, retry="temporary", error=str(exc))
        return _degraded("ApplyFailed", str(exc), generation, old_status, now, announce)
    except (CurveUnavailable, ForeignObject) as exc:  # the reason is the class's name
        return _degraded(type(exc).__name__, str(exc), generation, old_status, now, announce)
    replicas = desired_replicas(pool, held)
    deployments = {name: d for (kind, name), d in live.items() if kind == "Deployment"}
    counts = counts_for(replicas, deployments)
    try:
        met = all(c["ready"] >= c["desired"] for c in counts.values())
        # a pool scaled to no router has nothing behind its Service to wait for
        waiting = router.endpoint_waiting(kube, pool) if met and pool.router.replicas else ""
    except ApiError as exc:
        return Outcome(status={}, retry="temporary", error=str(exc))
    status = pool_status(
        counts,
        router.endpoint_url(pool),
        pool.hash_seed,
        generation,
        old_status.get("conditions"),
        now,
        endpoint_waiting=waiting,
    )
    outcome.recheck = bool(waiting)
    if old_status.get("autoscaling"):  # the autoscaler's last decisions, written by it
        status["autoscaling"] = old_status["autoscaling"]
    if pool.lora is not None:  # dynamic pools: load/unload the difference on ready pods
        status["lora"] = lora_sync.sync(kube, pool)
        if lora_sync.failing(status["lora"]) and not lora_sync.failing(old_status.get("lora")):
            message = "; ".join(e for v in status["lora"].values() for e in v.get("errors", []))
            outcome.events.append(("Warning", "LoraSyncFailed", message[:1024]))
    elif old_status.get("lora"):
        status["lora"] = None  # a merge patch deletes the section
    outcome.status = status
    if is_transition(old_status, status, "Ready") and status["phase"] == "Ready":
        outcome.events.append(("Normal", "Ready", f"all pods ready; endpoint {status['endpoint']}"))
    return outcome


def _apply_all(kube, pool, live, unserved, outcome, announce, held) -> None:
    objects = desired_objects(pool, held)
    keep = {(o["kind"], o["metadata"]["name"]) for o in objects}
    create_secrets(kube, pool, outcome)
    for obj in objects:
        if obj["kind"] in unserved:
            if announce:
                msg = f"{obj['kind']} is not served by this cluster (CRD missing); skipped"
                outcome.events.append(("Warning", f"No{obj['kind']}", msg))
            continue
        result = apply_object(kube, obj, live.get((obj["kind"], obj["metadata"]["name"])))
        if result != "unchanged":
            outcome.changed.append(f"{result} {obj['kind']} {obj['metadata']['name']}")
    outcome.changed += prune(kube, pool, live, keep)


def create_secrets(kube: Kube, pool: PoolSpec, outcome: Outcome) -> None:
    """Create the Secrets the operator generates, before the pods that mount them.

    The operator may only `create` Secrets (no get or list), so it posts each one on every
    pass and takes 409 AlreadyExists as done: an existing Secret is never read or rewritten.
    """
    for name, build in generated_secrets(pool):
        try:
            kube.create(build())
            outcome.changed.append(f"created Secret {name}")
        except ApiError as exc:
            if exc.status != 409:
                raise


def _degraded(reason: str, message: str, generation, old_status: dict, now: str, announce: bool):
    """A failure that needs a spec (or cluster policy) change; warns once per transition."""
    status = degraded_status(reason, message, generation, old_status, now)
    warn = announce and is_transition(old_status, status, "Degraded")
    events = [("Warning", reason, message)] if warn else []
    return Outcome(status=status, events=events, retry="permanent", error=message)
