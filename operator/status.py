"""Pure status aggregation: Deployment states in, the pool's `.status` out."""

from __future__ import annotations


def ready_replicas(deployment: dict | None) -> int:
    """Ready pods of a Deployment that run its current template (0 if it is missing)."""
    if not deployment:
        return 0
    status = deployment.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    if "updatedReplicas" in status:
        updated = int(status["updatedReplicas"] or 0)
        # during a rollout, ready pods may still be old ones: count only what must be new
        old = int(status.get("replicas") or 0) - updated
        ready = max(0, min(ready, updated, ready - old))
    generation = (deployment.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if generation is not None and observed is not None and observed < generation:
        return 0  # the controller has not looked at the current spec yet
    return ready


def _condition(ctype: str, ok: bool, reason: str, message: str, generation, old: dict, now: str):
    status = "True" if ok else "False"
    previous = old.get(ctype) or {}
    since = previous.get("lastTransitionTime") if previous.get("status") == status else None
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now,
        "observedGeneration": generation,
    }


def _by_type(conditions) -> dict:
    return {c.get("type"): c for c in conditions or [] if isinstance(c, dict)}


def pool_status(
    counts: dict[str, dict[str, int]],
    endpoint: str,
    hash_seed: str,
    generation: int | None,
    old_conditions: list | None,
    now: str,
    endpoint_waiting: str = "",
) -> dict:
    """Status of a valid pool from per-Deployment counts {key: {desired, ready}};
    `endpoint_waiting` says why the endpoint does not serve yet although the counts are met."""
    old = _by_type(old_conditions)
    lagging = sorted(k for k, c in counts.items() if c["ready"] < c["desired"])
    ready = not lagging and not endpoint_waiting
    desired = sum(c["desired"] for c in counts.values())
    up = sum(min(c["ready"], c["desired"]) for c in counts.values())
    waiting = endpoint_waiting or ""
    if lagging:
        waiting = "waiting for " + ", ".join(
            f"{k} {counts[k]['ready']}/{counts[k]['desired']}" for k in lagging
        )
    reason = "AllReplicasReady" if ready else "ReplicasNotReady" if lagging else "EndpointNotReady"
    conditions = [
        _condition(
            "Ready",
            ready,
            reason,
            f"{up}/{desired} pods ready" if ready else waiting,
            generation,
            old,
            now,
        ),
        _condition(
            "Progressing",
            not ready,
            "RollingOut" if not ready else "Complete",
            waiting if not ready else "all Deployments are up to date",
            generation,
            old,
            now,
        ),
        _condition("Degraded", False, "AsExpected", "", generation, old, now),
    ]
    return {
        "phase": "Ready" if ready else "Progressing",
        "observedGeneration": generation,
        "endpoint": endpoint,
        "ready": f"{up}/{desired}",
        "roles": counts,
        "conditions": conditions,
        "hashSeed": hash_seed,
    }


def degraded_status(
    reason: str, message: str, generation: int | None, old_status: dict | None, now: str
) -> dict:
    """Status for a pool the operator cannot (fully) realise: Degraded=True with a reason.

    Counts and endpoint of an earlier good state are kept: the children stay as they were.
    """
    old_status = old_status or {}
    old = _by_type(old_status.get("conditions"))
    was_ready = (old.get("Ready") or {}).get("status") == "True"
    ready_reason = (old.get("Ready") or {}).get("reason") or reason
    conditions = [
        _condition("Ready", was_ready, ready_reason, message, generation, old, now),
        _condition("Progressing", False, reason, message, generation, old, now),
        _condition("Degraded", True, reason, message, generation, old, now),
    ]
    out = {
        k: v
        for k, v in old_status.items()
        if k in ("endpoint", "ready", "roles", "hashSeed", "lora")
    }
    out.update(phase="Degraded", observedGeneration=generation, conditions=conditions)
    return out


def is_transition(old_status: dict | None, new_status: dict, ctype: str) -> bool:
    """Whether condition `ctype` changes status or reason (worth an Event)."""
    old = _by_type((old_status or {}).get("conditions")).get(ctype) or {}
    new = _by_type(new_status.get("conditions")).get(ctype) or {}
    return (old.get("status"), old.get("reason")) != (new.get("status"), new.get("reason"))


def counts_for(replicas: dict, deployments: dict) -> dict:
    """{key: {desired, ready}} from desired_replicas() and the live Deployments by name."""
    return {
        key: {"desired": want, "ready": ready_replicas(deployments.get(name))}
        for key, (name, want) in replicas.items()
    }
