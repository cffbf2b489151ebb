"""The chart's alerts fire on what they describe (`promtool test rules`, synthetic series)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from ipool_samples import ROOT
from prometheus_support import find_binary

RULES = ROOT / "charts" / "epdserve" / "files" / "prometheus-rules.yaml"
TESTS = Path(__file__).parent / "alert-rules-test.yaml"


def test_each_alert_fires_for_the_pod_it_names_and_clears():
    out = subprocess.run(
        [find_binary("promtool"), "test", "rules", TESTS.name],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_unit_test():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    firing = {
        case["alertname"]
        for test in yaml.safe_load(TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert alerts == firing
