"""``bench/routing_hot.py``, small: two stand-in pods behind the real router, a Zipf tenant mix
sent open-loop at a fixed rate (no calibration), two strategies; the JSON it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~15 s: CI runs it after make test

ROOT = Path(__file__).resolve().parents[1]


def test_a_small_standin_run_prints_every_strategys_figures(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench/routing_hot.py"), "--pods-kind", "standin"]
    cmd += ["--pods", "2", "--tenants", "3", "--requests", "16", "--rate", "20", "--preset", "tiny"]
    cmd += ["--strategies", "round-robin,prefix+cost", "--logs", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert (out["pods_kind"], out["shared_store"], out["offered_requests_per_s"]) == (
        "standin",
        False,
        20.0,
    )
    runs = out["runs"]
    assert set(runs) == {"round-robin", "prefix+cost"}
    for name, run in runs.items():
        assert sum(run["decisions"].values()) == 16, name  # every request routed once
        assert 0 <= run["prefix_hit_rate"] <= 1 and run["ttft_p90_ms"] >= run["ttft_p50_ms"]
    assert set(runs["round-robin"]["decisions"]) == {"round_robin"}
    assert out["ttft_p90_prefix_cost_vs_round_robin"] > 0
