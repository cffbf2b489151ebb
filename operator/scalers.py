"""Cluster autoscalers for autoscaled roles (pure builders): an autoscaling/v2 HPA per role
(`spec.autoscaling.engine: hpa`) or a KEDA ScaledObject (`engine: keda`).

The HPA reads a Pods metric through the custom-metrics API, so the cluster needs the
Prometheus adapter with rules that expose the engines' vLLM metrics under ADAPTER_METRICS'
names (docs/operator.md). KEDA queries Prometheus itself at `spec.autoscaling.prometheusAddress`.
"""

from __future__ import annotations

from epdserve.operator import meta
from epdserve.operator.autoscaling import RoleAutoscaling
from epdserve.operator.spec import PoolSpec

# spec metric -> name of the Pods metric the Prometheus adapter serves
ADAPTER_METRICS = {
    "waiting": "vllm_num_requests_waiting",
    "kvCacheUsage": "vllm_kv_cache_usage_perc",
    "ttftP90": "vllm_time_to_first_token_seconds_p90",
}


def quantity(value: float) -> str:
    """A target as a Kubernetes quantity, in thousandths (0.5 -> "500m", 4 -> "4")."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _behavior(policy: RoleAutoscaling) -> dict:
    return {
        "scaleUp": {"stabilizationWindowSeconds": policy.up_window_s},
        "scaleDown": {"stabilizationWindowSeconds": policy.down_window_s},
    }


def build_hpa(pool: PoolSpec, role: str) -> dict:
    """HorizontalPodAutoscaler `<pool>-<role>` on the role's per-pod vLLM metric."""
    policy = pool.roles[role].autoscaling
    name = meta.name_of(pool, role)
    metric = {
        "type": "Pods",
        "pods": {
            "metric": {"name": ADAPTER_METRICS[policy.metric]},
            "target": {"type": "AverageValue", "averageValue": quantity(policy.target)},
        },
    }
    return meta.stamp(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": meta.metadata(pool, name, "engine", role),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicas": policy.min_replicas,
                "maxReplicas": policy.max_replicas,
                "metrics": [metric],
                "behavior": _behavior(policy),
            },
        }
    )


def prometheus_query(pool: PoolSpec, role: str, metric: str) -> tuple[str, str]:
    """(PromQL, KEDA metricType): waiting is summed and shared out per pod by KEDA; KV-cache
    usage and TTFT p90 are pool-wide values compared with the target as they are."""
    sel = f'namespace="{pool.namespace}",pod=~"{meta.name_of(pool, role)}-.*"'
    if metric == "waiting":
        return f"sum(vllm:num_requests_waiting{{{sel}}})", "AverageValue"
    if metric == "kvCacheUsage":
        return f"avg(vllm:kv_cache_usage_perc{{{sel}}})", "Value"
    rate = f"rate(vllm:time_to_first_token_seconds_bucket{{{sel}}}[2m])"
    return f"histogram_quantile(0.9, sum by (le) ({rate}))", "Value"


def build_scaled_object(pool: PoolSpec, role: str) -> dict:
    """KEDA ScaledObject `<pool>-<role>` with one prometheus trigger."""
    policy = pool.roles[role].autoscaling
    name = meta.name_of(pool, role)
    query, metric_type = prometheus_query(pool, role, policy.metric)
    trigger = {
        "type": "prometheus",
        "metricType": metric_type,
        "metadata": {
            "serverAddress": pool.autoscaling.prometheus_address,
            "query": query,
            "threshold": f"{policy.target:g}",
        },
    }
    return meta.stamp(
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": meta.metadata(pool, name, "engine", role),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicaCount": policy.min_replicas,
                "maxReplicaCount": policy.max_replicas,
                "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(policy)}},
                "triggers": [trigger],
            },
        }
    )


def build_scalers(pool: PoolSpec) -> list[dict]:
    """The HPAs or ScaledObjects of the pool's autoscaled roles (none for engine operator)."""
    build = {"hpa": build_hpa, "keda": build_scaled_object}.get(pool.autoscaling.engine)
    if build is None:
        return []
    return [build(pool, role) for role, spec in pool.roles.items() if spec.autoscaling]
