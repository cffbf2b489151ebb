"""Autoscaling: the spec block, the metric read from /metrics text, and the decision."""

from __future__ import annotations

import pytest
from ipool_samples import pool_body

from epdserve.common.metrics_text import buckets
from epdserve.operator.autoscaling import (
    RoleAutoscaling,
    desired_replicas,
    histogram_delta,
    pod_value,
    quantile,
)
from epdserve.operator.desired import desired_objects  # noqa: F401  (imports spec without a cycle)
from epdserve.operator.spec import InvalidSpec, parse_pool

POLICY = RoleAutoscaling(min_replicas=1, max_replicas=10, metric="waiting", target=4.0)
METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.7
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="tiny"} 50.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="tiny"} 100.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"} 100.0
"""


def _pd(prefill: dict | None = None, decode: dict | None = None, **spec) -> dict:
    roles = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    if prefill:
        roles["prefill"]["autoscaling"] = prefill
    if decode:
        roles["decode"]["autoscaling"] = decode
    return pool_body(roles=roles, cache={"backend": "redis", "redis": {"managed": True}}, **spec)


def test_prefill_and_decode_parse_their_own_autoscaling():
    pool = parse_pool(
        _pd({"maxReplicas": 4, "target": 2}, {"maxReplicas": 8, "metric": "ttftP90", "target": 0.5})
    )
    assert pool.roles["prefill"].autoscaling == RoleAutoscaling(1, 4, "waiting", 2.0, 0, 300)
    assert pool.roles["decode"].autoscaling.metric == "ttftP90"
    assert pool.autoscaling.engine == "operator"


def test_a_role_without_the_block_keeps_a_fixed_size():
    assert parse_pool(_pd()).roles["prefill"].autoscaling is None


@pytest.mark.parametrize(
    ("block", "field"),
    [
        ({"minReplicas": 3, "maxReplicas": 2, "target": 1}, "maxReplicas"),
        ({"maxReplicas": 2, "metric": "cpu", "target": 1}, "metric"),
        ({"maxReplicas": 2, "target": 0}, "target"),
        ({"target": 1}, "maxReplicas"),
    ],
)
def test_invalid_autoscaling_names_the_field(block, field):
    with pytest.raises(InvalidSpec, match=rf"spec\.roles\.prefill\.autoscaling\.{field}"):
        parse_pool(_pd(block))


def test_keda_needs_a_prometheus_address():
    with pytest.raises(InvalidSpec, match="prometheusAddress"):
        parse_pool(_pd(autoscaling={"engine": "keda"}))


def test_waiting_is_summed_per_pod_and_kv_usage_averaged():
    assert pod_value(METRICS, "waiting") == 5.0
    assert pod_value(METRICS, "kvCacheUsage") == pytest.approx(0.6)
    assert pod_value("# nothing\n", "waiting") is None


def test_ttft_p90_interpolates_within_the_bucket():
    assert quantile(0.9, buckets(METRICS, "vllm:time_to_first_token_seconds")) == pytest.approx(0.9)


def test_histogram_delta_counts_only_new_observations():
    before = {0.1: 10.0, 1.0: 20.0, float("inf"): 20.0}
    after = {0.1: 10.0, 1.0: 30.0, float("inf"): 30.0}
    assert histogram_delta(after, before) == {0.1: 0.0, 1.0: 10.0, float("inf"): 10.0}
    assert quantile(0.9, histogram_delta(after, before)) > 0.1
    assert quantile(0.9, histogram_delta(before, before)) is None  # nothing new: no sample


def test_histogram_delta_restarts_with_a_restarted_pod():
    assert histogram_delta({1.0: 2.0}, {1.0: 50.0}) == {1.0: 2.0}


def test_scales_up_proportionally():
    decision = desired_replicas(2, [12.0, 8.0], POLICY, [], now=0.0)
    assert decision.replicas == 5  # ceil(2 * 10 / 4)
    assert "2 -> 5" in decision.reason


def test_within_tolerance_nothing_changes():
    assert desired_replicas(3, [4.3], POLICY, [], now=0.0).replicas == 3


def test_clamped_to_max_and_min():
    assert desired_replicas(2, [400.0], POLICY, [], now=0.0).replicas == 10
    assert desired_replicas(3, [0.0], POLICY, [], now=0.0).replicas == 1


def test_scale_down_uses_the_highest_recommendation_in_the_window():
    history: list = []
    policy = RoleAutoscaling(1, 10, "waiting", 4.0, down_window_s=60)
    assert desired_replicas(4, [4.0], policy, history, now=0.0).replicas == 4
    held = desired_replicas(4, [1.0], policy, history, now=30.0)
    assert held.replicas == 4 and "scale-down window" in held.reason
    assert desired_replicas(4, [1.0], policy, history, now=61.0).replicas == 1


def test_scale_up_uses_the_lowest_recommendation_in_the_window():
    history: list = []
    policy = RoleAutoscaling(1, 10, "waiting", 4.0, up_window_s=60, down_window_s=0)
    desired_replicas(2, [4.0], policy, history, now=0.0)
    assert desired_replicas(2, [16.0], policy, history, now=10.0).replicas == 2
    assert desired_replicas(2, [16.0], policy, history, now=70.0).replicas == 8


def test_no_metrics_only_clamps():
    decision = desired_replicas(12, [], POLICY, [], now=0.0)
    assert decision.replicas == 10 and "no metrics" in decision.reason
