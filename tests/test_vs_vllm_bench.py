"""``bench/vs_vllm.py``'s aggregation (no vLLM, no engine: rounds are given)."""

from __future__ import annotations

import json
import subprocess
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


def test_every_preset_runs_by_default_and_real_shapes_get_a_smaller_offline_workload():
    assert vs_vllm.parse_args([]).presets == ["tiny", "qwen2.5-0.5b", "llama3.2-1b"]
    assert vs_vllm.parse_args(["--arch", "qwen3_moe"]).presets == ["tiny", "moe-0.6b"]
    assert sets.offline_workload("tiny", quick=False) == {
        "prompts": 256,
        "input": 128,
        "output": 128,
    }
    for preset in ("qwen2.5-0.5b", "llama3.2-1b"):
        assert sets.offline_workload(preset, quick=False) == {
            "prompts": 64,
            "input": 128,
            "output": 64,
        }
        assert sets.offline_workload(preset, quick=True) == sets.offline_workload("tiny", True)


def test_the_plan_says_which_bf16_units_the_cpu_has(monkeypatch):
    from epdserve.kernels import native_build

    monkeypatch.setattr(native_build, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    args = vs_vllm.parse_args(["--presets", "llama3.2-1b", "tiny"])
    plan = vs_vllm.plan(args)
    assert plan["cpu"]["amx_bf16"] is True and plan["cpu"]["avx512_bf16"] is False
    assert list(plan["presets"]) == ["llama3.2-1b", "tiny"]
    assert plan["presets"]["llama3.2-1b"]["offline_workload"]["prompts"] == 64


def test_each_preset_gets_its_own_checkpoint_results_and_ratios(monkeypatch, capsys):
    made = []

    def fake_checkpoint(out, preset, arch):
        made.append((arch, preset))
        out.mkdir()
        return out

    def fake_offline(python, model, args, work):
        ratio = work["prompts"] / 100  # tells the presets' workloads apart
        return {"defaults": {"ratio_ours_over_vllm": {"output_tok_per_s": ratio}}}

    monkeypatch.setattr(vs_vllm_env, "ensure_vllm", lambda venv, install: ("0.32 2.13", ""))
    monkeypatch.setattr(vs_vllm_env, "make_checkpoint", fake_checkpoint)
    monkeypatch.setattr(vs_vllm, "offline", fake_offline)
    vs_vllm.main(["--presets", "tiny", "qwen2.5-0.5b", "--skip", "served", "--rounds", "1"])
    result = json.loads(capsys.readouterr().out)
    assert made == [("llama", "tiny"), ("llama", "qwen2.5-0.5b")]
    assert result["ratios"] == {
        "tiny": {"offline_defaults": 2.56},
        "qwen2.5-0.5b": {"offline_defaults": 0.64},
    }
    assert set(result["cpu"]) == {"model", "amx_bf16", "avx512_bf16"}
    assert "served" not in result["presets"]["tiny"]


def test_without_vllm_the_bench_prints_its_plan_and_why_it_skipped(tmp_path):
    bench = Path(__file__).resolve().parents[1] / "bench" / "vs_vllm.py"
    cmd = [sys.executable, str(bench), "--no-install", "--vllm-venv", str(tmp_path / "none")]
    res = subprocess.run(
        [*cmd, "--presets", "qwen2.5-0.5b", "--quick"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["skipped"].startswith("vLLM unavailable")
    assert list(result["presets"]) == ["qwen2.5-0.5b"]
    assert isinstance(result["cpu"]["avx512_bf16"], bool)
