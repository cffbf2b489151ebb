"""HPA and KEDA ScaledObject builders for autoscaled roles (engine hpa / keda)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from ipool_samples import example

from epdserve.operator.desired import desired_objects
from epdserve.operator.scalers import build_hpa, build_scaled_object, quantity
from epdserve.operator.spec import parse_pool

PROMETHEUS = "http://prometheus.monitoring:9090"


def _pool(engine: str):
    body = example("autoscaled-pd")
    body["spec"]["autoscaling"] = {"engine": engine, "prometheusAddress": PROMETHEUS}
    return parse_pool(body)


def _kinds(pool) -> list[str]:
    return [o["kind"] for o in desired_objects(pool)]


def test_operator_engine_emits_no_cluster_autoscaler():
    kinds = _kinds(parse_pool(example("autoscaled-pd")))
    assert "HorizontalPodAutoscaler" not in kinds and "ScaledObject" not in kinds


def test_hpa_engine_emits_one_hpa_per_autoscaled_role_after_the_deployments():
    kinds = _kinds(_pool("hpa"))
    assert kinds.count("HorizontalPodAutoscaler") == 2 and "ScaledObject" not in kinds
    assert kinds.index("HorizontalPodAutoscaler") > max(
        i for i, k in enumerate(kinds) if k == "Deployment"
    )


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_hpa_is_valid_kubernetes(version):
    kubernetes_validate.validate(build_hpa(_pool("hpa"), "decode"), version, strict=True)


def test_hpa_targets_the_role_deployment_on_a_pods_metric():
    hpa = build_hpa(_pool("hpa"), "prefill")
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "llama-elastic-prefill",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)
    (metric,) = spec["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_targets_become_quantities():
    assert (quantity(0.5), quantity(4), quantity(0.85)) == ("500m", "4", "850m")


def test_scaled_object_has_a_prometheus_trigger():
    obj = build_scaled_object(_pool("keda"), "decode")
    assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject"
    spec = obj["spec"]
    assert spec["scaleTargetRef"]["name"] == "llama-elastic-decode"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 8)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == PROMETHEUS and meta["threshold"] == "0.5"
    assert meta["query"].startswith("histogram_quantile(0.9,")
    assert 'pod=~"llama-elastic-decode-.*"' in meta["query"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 30


def test_waiting_is_shared_out_per_pod_by_keda():
    (trigger,) = build_scaled_object(_pool("keda"), "prefill")["spec"]["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
