"""``bench/structured.py``'s plan, client flags, schema and JSON aggregation (no servers:
runs are given)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import structured as bench  # noqa: E402


def run(tok_s: float, share: float = 1.0, tokens: int = 8192) -> dict:
    return {"output_throughput": tok_s, "request_throughput": tok_s / 128,
            "median_ttft_ms": 100.0, "grammar_prefix_share": share, "output_tokens": tokens}  # fmt: skip


def engine(plain: list[float], json_: list[float], probes_valid: bool = True) -> dict:
    return {"probes": [{"text": "{}", "valid": probes_valid}],
            "runs": {"plain": [run(x, share=0.0) for x in plain],
                     "json": [run(x) for x in json_]}}  # fmt: skip


def test_our_overhead_is_one_minus_json_over_plain_medians():
    out = bench.aggregate(engine([100.0, 300.0, 200.0], [90.0, 250.0, 180.0]), {})
    assert out["epdserve"]["median"]["plain"]["output_throughput"] == 200.0
    assert out["epdserve"]["median"]["json"]["output_throughput"] == 180.0
    assert out["ratios"] == {"ours_overhead": 0.1}
    assert out["epdserve"]["overhead_per_round"] == [0.1, 0.167, 0.1]
    assert out["goals"]["ours_overhead"] == {"goal": "<= 0.15", "value": 0.1, "met": True}
    assert out["goals"]["ours_over_vllm_json"]["met"] is False
    assert "vllm" not in out


def test_vllm_json_and_plain_each_at_their_best_variant_and_failed_ones_are_skipped():
    ours = engine([200.0, 200.0], [160.0, 160.0])
    vllm = {
        "auto": engine([300.0, 300.0], [100.0, 100.0]),
        "nobind": engine([250.0, 250.0], [125.0, 125.0]),
        "broken": {"error": "did not start"},
    }
    out = bench.aggregate(ours, vllm)
    assert (out["vllm"]["variant"], out["vllm"]["variant_plain"]) == ("nobind", "auto")
    assert set(out["vllm"]["variants"]) == {"auto", "nobind"}
    assert out["vllm"]["overhead"] == 0.5  # the json variant's own
    assert out["ratios"] == {"ours_overhead": 0.2, "vllm_overhead": 0.583,
                             "ours_over_vllm_json": 1.28, "ours_over_vllm_plain": 0.667}  # fmt: skip
    assert out["goals"]["ours_over_vllm_json"]["met"] is True
    assert out["goals"]["ours_overhead"]["met"] is False


def test_checks_report_probes_grammar_shares_and_output_tokens():
    ours = engine([200.0], [180.0], probes_valid=False)
    ours["runs"]["json"].append(run(170.0, share=0.5, tokens=8000))
    ours["runs"]["plain"].append(run(190.0, share=0.25))
    checks = bench.aggregate(ours, {})["epdserve"]["checks"]
    assert checks == {"probes_valid": False, "json_outputs_in_grammar": 0.5,
                      "plain_outputs_in_grammar": 0.25, "output_tokens": [8000, 8192]}  # fmt: skip


def test_merge_joins_the_runs_and_probes_of_both_starts():
    a = {"server_start_s": 3.0, "probe": {"valid": True}, "runs": engine([1.0], [2.0])["runs"]}
    b = {"server_start_s": 4.0, "probe": {"valid": False}, "runs": engine([3.0], [4.0])["runs"]}
    merged = bench.merge([a, b])
    assert [r["output_throughput"] for r in merged["runs"]["json"]] == [2.0, 4.0]
    assert merged["probes"] == [{"valid": True}, {"valid": False}]
    assert merged["server_start_s"] == [3.0, 4.0]


def test_plan_alternates_traffic_with_one_seed_per_round_and_json_carries_the_schema():
    plan = bench.make_plan(2, quick=True)
    assert [(t, s) for t, _, s in plan] == [("plain", 400), ("json", 400),
                                             ("json", 401), ("plain", 401)]  # fmt: skip
    assert plan[0][1][-1] is None and plan[0][1][:-1] == bench.CASES["random"][1]
    body = plan[1][1][-1]
    assert body == {"structured_outputs": {"json": bench.SCHEMA, "disable_any_whitespace": True}}
    assert bench.ORDERS["both"] == ("epdserve", "vllm", "vllm", "epdserve")


def test_client_sends_the_extra_body_only_for_json_traffic():
    server = object.__new__(bench.StructuredServer)
    server.vllm_python, server.url, server.model, server.tmp = "py", "http://h", "/m", Path("/t")
    body = bench.json_body(bench.SCHEMA)
    constrained = server.client_command((16, 128, 32, 0, body), seed=3)
    assert constrained[-2:] == ["--extra-body", json.dumps(body)]
    assert "--save-detailed" in constrained and "--ignore-eos" in constrained
    plain = server.client_command((16, 128, 32, 0, None), seed=3)
    assert "--extra-body" not in plain and plain[plain.index("--seed") + 1] == "3"


def test_no_output_can_complete_the_schema_within_128_tokens(models):
    from jsonschema import validate

    from epdserve.engine.structured import backend

    record = {"id": 0, "name": "a", "ok": True, "score": 0, "tags": []}
    shortest = json.dumps({"records": [record] * 128})  # ", " and ": ": xgrammar's separators
    validate(json.loads(shortest), bench.SCHEMA)
    info = backend.tokenizer_info(models.get("llama"), 4096, [2])
    longest_token = max(len(t) for t in info.decoded_vocab)
    assert len(shortest.encode()) / longest_token > 128
    accepts = bench.prefix_checker(models.get("llama"))
    assert accepts(shortest[:200]) and accepts('{"records": [{"id": 12')
    assert accepts(json.dumps({"records": [record] * 3}, separators=(",", ":"))[:-2])  # vLLM's
    assert accepts('{"records":[{"id": 1,"name":"ab"')  # vLLM's xgrammar 0.2.8 mixes them
    assert not accepts("hello") and not accepts('{"records": []}')
