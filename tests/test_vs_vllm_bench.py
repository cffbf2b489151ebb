"""``bench/vs_vllm.py``'s aggregation (no vLLM, no engine: rounds are given)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import vs_vllm  # noqa: E402
import vs_vllm_env  # noqa: E402


def test_median_of_odd_and_even_counts():
    assert vs_vllm.median([3.0, 1.0, 2.0]) == 2.0
    assert vs_vllm.median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_compare_reports_per_side_medians_and_ours_over_theirs():
    ours = [{"tok_s": 100.0, "cpu": {"x": 1}}, {"tok_s": 300.0}, {"tok_s": 200.0}]
    theirs = [{"tok_s": 100.0}, {"tok_s": 100.0}, {"tok_s": 400.0}]
    out = vs_vllm.compare(ours, theirs, ("tok_s",))
    assert out["epdserve"]["median"] == {"tok_s": 200.0}
    assert out["vllm"]["median"] == {"tok_s": 100.0}
    assert out["ratio_ours_over_vllm"] == {"tok_s": 2.0}
    assert out["epdserve"]["rounds"] == ours


def test_headline_gives_the_three_throughput_ratios_and_served_ttft():
    def case(metric, ratio, ttft=None):
        ratios = {metric: ratio} | ({"median_ttft_ms": ttft} if ttft else {})
        return {"ratio_ours_over_vllm": ratios}

    result = {
        "a_offline": case("output_tok_per_s", 1.5),
        "b_served_random": case("output_throughput", 1.25, 0.8),
        "c_served_shared_prefix": case("output_throughput", 0.9, 1.1),
    }
    assert vs_vllm.headline(result) == {
        "a_offline": 1.5,
        "b_served_random": 1.25,
        "b_served_random_ttft_p50": 0.8,
        "c_served_shared_prefix": 0.9,
        "c_served_shared_prefix_ttft_p50": 1.1,
    }


def test_rounds_alternate_which_engine_goes_first():
    assert [vs_vllm.round_order(r)[0] for r in range(4)] == ["epdserve", "vllm"] * 2


def test_both_engines_get_the_same_explicit_thread_settings():
    env = vs_vllm_env.thread_env(3)
    assert env == {"OMP_NUM_THREADS": "3", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_cpu_delta_keeps_only_processes_that_used_cpu():
    before = {"a:1": 1.0, "b:2": 2.0}
    after = {"a:1": 1.5, "b:2": 2.0, "c:3": 0.25}
    assert vs_vllm_env.cpu_delta(before, after) == {"a:1": 0.5, "c:3": 0.25}
