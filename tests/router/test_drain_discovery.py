"""Scale-down: a terminating pod leaves rotation at the first event that says so."""

from __future__ import annotations

import datetime

import pytest

from epdserve.router.discovery import KubernetesDiscovery, pod_is_ready
from epdserve.router.service import Router
from epdserve.router.strategy import make_strategy

client = pytest.importorskip("kubernetes.client")


def k8s_pod(terminating: bool) -> object:
    stamp = datetime.datetime.now(datetime.UTC) if terminating else None
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="e0", labels={"app": "engine"}, deletion_timestamp=stamp),
        status=client.V1PodStatus(
            phase="Running",
            pod_ip="10.0.0.1",
            conditions=[client.V1PodCondition(type="Ready", status="True")],
        ),
    )


def test_a_terminating_pod_is_not_ready_even_while_its_probe_still_passes():
    assert pod_is_ready(k8s_pod(terminating=False))
    assert not pod_is_ready(k8s_pod(terminating=True))


def test_the_terminating_event_takes_the_pod_out_of_rotation_at_once():
    router = Router(make_strategy("round-robin"), None, subscribe=False)
    discovery = KubernetesDiscovery("ns", "app=engine", 8000, 5557, 5558)
    try:
        discovery._on_event(router, "ADDED", k8s_pod(terminating=False))
        assert [p.name for p in router.pods()] == ["10.0.0.1:8000"]
        discovery._on_event(router, "MODIFIED", k8s_pod(terminating=True))
        assert router.pods() == []
    finally:
        router.close()
