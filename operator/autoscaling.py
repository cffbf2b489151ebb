"""Per-role autoscaling: the spec block, the pods' metric, and the scaling decision (pure).

The decision is proportional: `ceil(current * metric / target)`, left alone within a 10 %
tolerance, clamped to [minReplicas, maxReplicas], and damped by two stabilization windows
(up: the lowest recommendation of the up-window; down: the highest of the down-window), so a
short spike neither adds pods nor a short lull removes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from epdserve.common import metrics_text
from epdserve.operator.errors import InvalidSpec

ENGINES = ("operator", "hpa", "keda")
# spec metric -> the vLLM metric family it reads
METRICS = {
    "waiting": "vllm:num_requests_waiting",
    "kvCacheUsage": "vllm:kv_cache_usage_perc",
    "ttftP90": "vllm:time_to_first_token_seconds",
}
TOLERANCE = 0.1


@dataclass(frozen=True)
class RoleAutoscaling:
    """How one role scales: bounds, the metric and its per-pod target, the two windows."""

    min_replicas: int
    max_replicas: int
    metric: str  # a key of METRICS
    target: float
    up_window_s: int = 0
    down_window_s: int = 300


@dataclass(frozen=True)
class AutoscalingSpec:
    """Pool-level settings: who runs the loop, and where KEDA finds Prometheus."""

    engine: str = "operator"
    prometheus_address: str | None = None


def _whole(raw: dict, key: str, where: str, default: int | None, least: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidSpec(f"{where}.{key}: a whole number >= {least}, got {value!r}")
    return value


def parse_role_autoscaling(raw: dict | None, where: str) -> RoleAutoscaling | None:
    """`spec.roles.<role>.autoscaling`, validated; None when the role has a fixed size."""
    if not raw:
        return None
    where = f"{where}.autoscaling"
    lo = _whole(raw, "minReplicas", where, 1, 1)
    hi = _whole(raw, "maxReplicas", where, None, 1)
    if hi < lo:
        raise InvalidSpec(f"{where}.maxReplicas: {hi} is below minReplicas {lo}")
    metric = raw.get("metric", "waiting")
    if metric not in METRICS:
        raise InvalidSpec(f"{where}.metric: one of {', '.join(METRICS)}, got {metric!r}")
    target = raw.get("target")
    if isinstance(target, bool) or not isinstance(target, int | float) or target <= 0:
        raise InvalidSpec(f"{where}.target: a number > 0, got {target!r}")
    return RoleAutoscaling(
        min_replicas=lo,
        max_replicas=hi,
        metric=metric,
        target=float(target),
        up_window_s=_whole(raw, "scaleUpStabilizationSeconds", where, 0, 0),
        down_window_s=_whole(raw, "scaleDownStabilizationSeconds", where, 300, 0),
    )


def parse_autoscaling(raw: dict | None) -> AutoscalingSpec:
    """Pool-level `spec.autoscaling`, validated."""
    raw = raw or {}
    engine = raw.get("engine", "operator")
    if engine not in ENGINES:
        raise InvalidSpec(f"spec.autoscaling.engine: one of {', '.join(ENGINES)}, got {engine!r}")
    address = raw.get("prometheusAddress")
    if engine == "keda" and not address:
        raise InvalidSpec("spec.autoscaling.prometheusAddress is required for engine keda")
    return AutoscalingSpec(engine=engine, prometheus_address=address)


# --- the metric, from the pods' /metrics pages ---


def pod_value(page: metrics_text.Page, metric: str) -> float | None:
    """One pod's gauge: waiting requests summed over series, KV-cache usage averaged."""
    values = metrics_text.values(page, METRICS[metric])
    if not values:
        return None
    return sum(values) if metric == "waiting" else sum(values) / len(values)


def histogram_delta(now: dict[float, float], before: dict[float, float] | None) -> dict:
    """Bucket counts observed since `before` (a restarted pod's counters start again)."""
    if not before or any(now.get(b, 0.0) < c for b, c in before.items()):
        return dict(now)
    return {b: c - before.get(b, 0.0) for b, c in now.items()}


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile of cumulative bucket counts, linear within the bucket; None if empty."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is the best estimate
            span = count - below
            return lower + (bound - lower) * ((rank - below) / span if span else 1.0)
        lower, below = bound, count
    return lower


# --- the decision ---


@dataclass(frozen=True)
class Decision:
    """The replicas to run and why, in words for the status and the Event."""

    replicas: int
    reason: str


def proportional(current: int, value: float, target: float) -> int:
    """`ceil(current * value / target)`, or `current` within the tolerance."""
    ratio = value / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return math.ceil(current * ratio)


def desired_replicas(
    current: int,
    samples_per_pod: list[float],
    policy: RoleAutoscaling,
    history: list[tuple[float, int]],
    now: float,
) -> Decision:
    """The role's next replica count; appends this recommendation to `history` (and prunes it).

    `samples_per_pod` holds the metric of each ready pod (one pool-wide value for TTFT p90);
    with none, the size is only clamped to the bounds.
    """
    lo, hi = policy.min_replicas, policy.max_replicas
    if not samples_per_pod:
        replicas = min(max(current, lo), hi)
        return Decision(replicas, "no metrics from ready pods; size kept within bounds")
    value = sum(samples_per_pod) / len(samples_per_pod)
    recommended = min(max(proportional(max(current, 1), value, policy.target), lo), hi)
    history.append((now, recommended))
    keep = max(policy.up_window_s, policy.down_window_s)
    history[:] = [(t, r) for t, r in history if t >= now - keep]
    what = f"{policy.metric} {value:.3g} vs target {policy.target:g}"
    if recommended > current:
        window = [r for t, r in history if t >= now - policy.up_window_s]
        replicas = max(current, min(window))
        held = " (held by the scale-up window)" if replicas < recommended else ""
    elif recommended < current:
        window = [r for t, r in history if t >= now - policy.down_window_s]
        replicas = min(current, max(window))
        held = " (held by the scale-down window)" if replicas > recommended else ""
    else:
        replicas, held = current, ""
    replicas = min(max(replicas, lo), hi)
    return Decision(replicas, f"{what}: {current} -> {replicas}{held}")
