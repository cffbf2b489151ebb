"""The operator's per-pool ServiceMonitor and the chart's ServiceMonitor select every engine
and router pod, once, on its `http` port, with the `pool` and `role` labels the dashboard
selects by (targets computed as prometheus-operator would; see monitor_targets.py)."""

from __future__ import annotations

import helm_python as helm
import pytest
import yaml
from ipool_samples import ROOT, example
from monitor_targets import monitor_targets, service_monitor

from epdserve.operator.desired import desired_objects
from epdserve.operator.spec import parse_pool

CHART = ROOT / "charts" / "epdserve"


def chart_service_monitor(values: dict) -> dict:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name="epd", namespace="epdserve-system")
    docs = [
        d
        for path, text in files.items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
    ]
    (monitor,) = [d for d in docs if d and d["kind"] == "ServiceMonitor"]
    return monitor


@pytest.mark.parametrize("name", ["pd-redis", "colocated-text", "epd-multimodal"])
def test_service_monitors_scrape_every_engine_and_router_pod_on_its_http_port(name):
    body = example(name)
    body["spec"]["metrics"] = {"serviceMonitor": {"enabled": True}}
    objects = desired_objects(parse_pool(body))
    want = {
        o["metadata"]["name"]
        for o in objects
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        in ("engine", "router")
    }
    pool_targets = monitor_targets(service_monitor(objects), objects)
    assert sorted(t.deployment for t in pool_targets) == sorted(want)  # each pod once
    for t in pool_targets:
        assert (t.port, t.path) == (8000, "/metrics"), t
        labels = dict(t.labels)
        assert labels["namespace"] == body["metadata"]["namespace"], t
        assert labels["pool"] == body["metadata"]["name"], t  # what the dashboard selects by
        assert t.deployment == f"{labels['pool']}-{labels['role']}", t  # role: prefill, router...
    namespace = body["metadata"]["namespace"]
    for values in ({}, {"watchNamespaces": [namespace, "other"]}):
        chart = chart_service_monitor({**values, "serviceMonitor": {"enabled": True}})
        assert set(monitor_targets(chart, objects)) == set(pool_targets)
    elsewhere = chart_service_monitor(
        {"watchNamespaces": ["other"], "serviceMonitor": {"enabled": True}}
    )
    assert monitor_targets(elsewhere, objects) == []
