"""Pure builders: engine pods stop gracefully (preStop sleep, then a bounded drain)."""

from __future__ import annotations

import kubernetes_validate
from ipool_samples import pool_body

from epdserve.operator import engine
from epdserve.operator.spec import parse_pool


def _colocated(**role) -> dict:
    return pool_body(roles={"colocated": {"replicas": 2, **role}})


def _pod_spec(body: dict) -> dict:
    pool = parse_pool(body)
    return engine.build_engine_deployment(pool, "colocated")["spec"]["template"]["spec"]


def test_engine_pods_sleep_in_prestop_so_routing_drops_them_before_sigterm():
    container = _pod_spec(_colocated())["containers"][0]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": engine.PRESTOP_SLEEP_S}}}


def test_grace_period_covers_prestop_the_default_drain_and_a_margin():
    spec = _pod_spec(_colocated())
    assert spec["terminationGracePeriodSeconds"] == 5 + 30 + engine.STOP_MARGIN_S


def test_a_drain_timeout_in_the_role_args_lengthens_the_grace_period():
    spec = _pod_spec(_colocated(args=["--drain-timeout", "120"]))
    assert spec["terminationGracePeriodSeconds"] == 5 + 120 + engine.STOP_MARGIN_S


def test_a_drain_timeout_in_the_role_env_lengthens_the_grace_period():
    env = [{"name": "EPDSERVE_DRAIN_TIMEOUT", "value": "90.5"}]
    spec = _pod_spec(_colocated(env=env))
    assert spec["terminationGracePeriodSeconds"] == 5 + 91 + engine.STOP_MARGIN_S


def test_an_unreadable_drain_timeout_keeps_the_default_grace_period():
    spec = _pod_spec(_colocated(args=["--drain-timeout=soon"]))
    assert spec["terminationGracePeriodSeconds"] == 5 + 30 + engine.STOP_MARGIN_S


def test_the_prestop_sleep_action_is_valid_kubernetes():
    dep = engine.build_engine_deployment(parse_pool(_colocated()), "colocated")
    for version in ("1.30.0", "1.33.0"):
        kubernetes_validate.validate(dep, version, strict=True)
