"""``bench/lora.py``'s plan, flags and JSON aggregation (no servers: rounds are given)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import lora as bench  # noqa: E402

NAMES = ["lora0", "lora1", "lora2", "lora3"]


def run(tok_s: float, ttft: float = 100.0) -> dict:
    """A run whose server CPU seconds are 20 x 128 / tok_s (as if CPU-bound)."""
    return {"output_throughput": tok_s, "request_throughput": tok_s / 128,
            "median_ttft_ms": ttft, "median_itl_ms": 5.0,
            "server_cpu_s": {"api:1": 1.0, "core:2": 20 * 128 / tok_s - 1.0}}  # fmt: skip


def engine(base: list[float], mixed: list[float], probe: dict | None = None) -> dict:
    texts = probe or {"bench": "a", **{n: n for n in NAMES}}
    return {"runs": {"base": [run(x) for x in base], "mixed": [run(x) for x in mixed]},
            "probe": texts}  # fmt: skip


def test_ours_mixed_over_base_from_medians_and_per_round():
    out = bench.aggregate(engine([100.0, 300.0, 200.0], [90.0, 150.0, 160.0]), {}, NAMES)
    assert out["epdserve"]["median"]["base"]["output_throughput"] == 200.0
    assert out["epdserve"]["median"]["mixed"]["output_throughput"] == 150.0
    assert out["ratios"] == {"ours_mixed_over_base": 0.75, "ours_server_cpu_base_over_mixed": 0.75}
    assert out["epdserve"]["mixed_over_base_per_round"] == [0.9, 0.5, 0.8]
    assert out["goals"]["ours_mixed_over_base"] == {"goal": 0.7, "value": 0.75, "met": True}
    assert out["goals"]["ours_over_vllm_mixed"]["met"] is False
    assert "vllm" not in out


def test_vllm_best_variant_is_chosen_per_traffic_and_failed_variants_are_skipped():
    ours = engine([200.0, 200.0], [180.0, 180.0])
    vllm = {
        "auto": engine([100.0, 100.0], [60.0, 60.0]),
        "nobind": engine([80.0, 80.0], [90.0, 90.0]),
        "broken": {"error": "refused the adapters"},
    }
    out = bench.aggregate(ours, vllm, NAMES)
    assert out["vllm"]["base"]["variant"] == "auto"
    assert out["vllm"]["mixed"]["variant"] == "nobind"
    assert set(out["vllm"]["variants"]) == {"auto", "nobind"}
    assert out["ratios"]["ours_over_vllm_mixed"] == 2.0
    assert out["ratios"]["ours_over_vllm_base"] == 2.0
    assert out["ratios"]["vllm_mixed_over_base"] == 0.9
    assert out["ratios"]["ours_mixed_over_base"] == 0.9
    assert out["ratios"]["ours_server_cpu_base_over_mixed"] == 0.9
    assert out["vllm"]["mixed"]["server_cpu_s"] == 20 * 128 / 90.0
    assert out["goals"]["ours_over_vllm_mixed"]["met"] is True


def test_probe_check_compares_each_adapter_with_base_and_across_engines():
    ours = {"bench": "x", "lora0": "y", "lora1": "x", "lora2": "z", "lora3": "w"}
    vllm = {"bench": "x", "lora0": "y", "lora1": "q", "lora2": "z", "lora3": "ERROR: 404"}
    out = bench.probe_check(ours, vllm, NAMES)
    assert out["lora0"] == {"ours_differs_from_base": True, "vllm_differs_from_base": True,
                            "same_text_both_engines": True}  # fmt: skip
    assert out["lora1"]["ours_differs_from_base"] is False
    assert out["lora1"]["same_text_both_engines"] is False
    assert out["lora3"]["same_text_both_engines"] is False


def test_plan_alternates_traffic_with_one_seed_per_round():
    plan = bench.make_plan(2, quick=True, names=NAMES)
    assert [(t, s) for t, _, s in plan] == [("base", 300), ("mixed", 300),
                                             ("mixed", 301), ("base", 301)]  # fmt: skip
    assert plan[0][1][-1] == () and plan[1][1][-1] == tuple(NAMES)
    assert plan[0][1][:-1] == bench.CASES["random"][1]


def test_lora_flags_per_engine_and_client_spreads_over_adapters():
    adapters = {"lora0": "/a", "lora1": "/b"}
    assert bench.lora_flags("vllm", adapters) == ["--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--lora-modules", "lora0=/a", "lora1=/b"]  # fmt: skip
    ours = bench.lora_flags("epdserve", adapters)
    assert ours[-4:] == ["--lora-modules", "lora0=/a", "--lora-modules", "lora1=/b"]
    server = object.__new__(bench.LoraServer)
    server.vllm_python, server.url, server.model, server.tmp = "py", "http://h", "/m", Path("/t")
    mixed = server.client_command((16, 128, 32, 0, ("lora0", "lora1")), seed=3)
    assert mixed[-5:] == ["--lora-modules", "lora0", "lora1", "--lora-assignment", "round-robin"]
    base = server.client_command((16, 128, 32, 0, ()), seed=3)
    assert "--lora-modules" not in base and base[base.index("--seed") + 1] == "3"
