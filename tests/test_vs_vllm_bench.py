"""``bench/vs_vllm.py``'s aggregation (no vLLM, no engine: rounds are given)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import vs_vllm  # noqa: E402
import vs_vllm_env  # noqa: E402
import vs_vllm_settings as sets  # noqa: E402


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


def test_headline_gives_every_offline_and_served_ratio():
    def case(metric, ratio, ttft=None):
        ratios = {metric: ratio} | ({"median_ttft_ms": ttft} if ttft else {})
        return {"ratio_ours_over_vllm": ratios}

    result = {
        "a_offline": {"defaults": case("output_tok_per_s", 1.5)},
        "served": {
            "matched": {
                "random": case("output_throughput", 1.25, 0.8),
                "shared_prefix": case("output_throughput", 0.9, 1.1),
            }
        },
    }
    assert vs_vllm.headline(result) == {
        "offline_defaults": 1.5,
        "served_matched_random": 1.25,
        "served_matched_random_ttft_p50": 0.8,
        "served_matched_shared_prefix": 0.9,
        "served_matched_shared_prefix_ttft_p50": 1.1,
    }


def test_ours_is_compared_with_vllms_best_variant_and_every_variant_is_kept():
    ours = [{"tok_s": 300.0}]
    vllm = {"auto": [{"tok_s": 100.0}, {"tok_s": 140.0}], "nobind": [{"tok_s": 200.0}]}
    out = vs_vllm.compare_best(ours, vllm, ("tok_s",), "tok_s")
    assert out["vllm_variant"] == "nobind"
    assert out["ratio_ours_over_vllm"] == {"tok_s": 1.5}
    assert out["vllm_variants"] == {"auto": {"tok_s": 120.0}, "nobind": {"tok_s": 200.0}}


def test_rounds_alternate_which_engine_goes_first():
    assert [vs_vllm.round_order(r)[0] for r in range(4)] == ["epdserve", "vllm"] * 2


def test_defaults_set_no_thread_variable_and_vllm_tries_its_binding_modes():
    assert sets.variants("epdserve", None, [0, 1]) == {"default": {}}
    assert sets.variants("vllm", None, [0, 1]) == {
        "auto": {},
        "nobind": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    }
    assert sets.variants("vllm", 2, [4, 5]) == {
        "nobind": {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        "bind": {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "4,5"},
    }
    assert sets.variants("epdserve", 1, [0, 1]) == {"default": {"OMP_NUM_THREADS": "1"}}


def test_the_bench_environment_loses_the_callers_thread_variables(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env = sets.base_env()
    assert "OMP_NUM_THREADS" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env


def test_matched_gives_both_engines_the_same_budget_and_defaults_give_none():
    ours, theirs = sets.serve_flags("matched", "epdserve"), sets.serve_flags("matched", "vllm")
    for flag in ("--block-size", "--max-num-batched-tokens", "--max-num-seqs"):
        assert ours[ours.index(flag) + 1] == theirs[theirs.index(flag) + 1]
    assert (
        ours[ours.index("--kv-cache-memory") + 1]
        == theirs[theirs.index("--kv-cache-memory-bytes") + 1]
    )
    assert "--block-size" not in sets.serve_flags("defaults", "epdserve")
    assert sets.engine_kwargs("matched", "vllm")["kv_cache_memory_bytes"] == sets.KV_BYTES
    assert sets.offline_cases([0, 1], [2, 1, 4]) == [
        ("defaults", None),
        ("matched", 2),
        ("matched", 1),
    ]


def test_cpu_delta_keeps_only_processes_that_used_cpu():
    before = {"a:1": 1.0, "b:2": 2.0}
    after = {"a:1": 1.5, "b:2": 2.0, "c:3": 0.25}
    assert vs_vllm_env.cpu_delta(before, after) == {"a:1": 0.5, "c:3": 0.25}
