"""``bench/routing.py``: its workload, affinity oracle and loss causes, and one small run of
the whole bench through the real router over stand-in pods (vLLM pods only where its venv is)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import routing  # noqa: E402
from routing_trace import classify, summarize  # noqa: E402

from epdserve.router.tokenize import PromptTokenizer  # noqa: E402


def tenant_ids(tenant: int, request: int, prefix: int, tail: int) -> list[int]:
    """Token ids: a tenant's own prefix, then a tail no other request has."""
    return [1000 * tenant + i for i in range(prefix)] + [
        10**6 + 1000 * request + i for i in range(tail)
    ]


def test_the_oracle_hits_every_full_prefix_block_of_a_tenants_later_requests():
    order = [0, 1, 0, 0, 1]
    reqs = [(t, "", tenant_ids(t, i, 8, 3)) for i, t in enumerate(order)]
    assert routing.affinity_oracle(reqs, 4) == [0, 0, 8, 8, 8]


def test_the_oracle_never_counts_the_last_prompt_token():
    # an 8-token prompt seen before: only the first block may hit (the last token is computed)
    reqs = [(0, "", list(range(8))), (0, "", list(range(8)))]
    assert routing.affinity_oracle(reqs, 4) == [0, 4]


def test_the_default_workloads_ideal_is_the_issues_0_784():
    tenants = [i % 8 for i in range(48)]
    reqs = [(t, "", tenant_ids(t, i, 512, 32)) for i, t in enumerate(tenants)]
    hits = routing.affinity_oracle(reqs, 32)
    assert sum(hits) == 40 * 512
    assert round(sum(hits) / (48 * 544), 4) == 0.7843


def test_workload_prompts_are_exactly_prefix_plus_tail_tokens_and_share_the_tenants_prefix(
    models,
):
    tok = PromptTokenizer(models.get("llama"))
    args = routing.parse_args(["--tenants", "3", "--requests", "7", "--prefix-tokens", "64"])
    reqs = routing.workload(tok, args, seed=1)
    assert sorted(t for t, _, _ in reqs) == [0, 0, 0, 1, 1, 2, 2]
    assert all(len(ids) == 64 + 32 for _, _, ids in reqs)
    by_tenant = {}
    for t, _, ids in reqs:
        by_tenant.setdefault(t, set()).add(tuple(ids[:64]))
    assert all(len(prefixes) == 1 for prefixes in by_tenant.values())
    assert len({next(iter(p)) for p in by_tenant.values()}) == 3


def test_a_short_hit_is_blamed_on_the_engine_the_routing_or_the_index():
    assert classify(512, 512, {"a": 16, "b": 0}, "a", 32) == "ok"
    assert classify(512, 0, {"a": 16, "b": 0}, "a", 32) == "engine_missed_indexed_blocks"
    assert classify(512, 0, {"a": 16, "b": 0}, "b", 32) == "routed_away_from_holder"
    assert classify(512, 0, {"a": 0, "b": 0}, "b", 32) == "prefix_not_indexed_anywhere"


def test_the_summary_counts_lost_tokens_per_cause_and_late_events():
    records = [
        {"loss": "ok", "ideal_hit_tokens": 0, "hit_tokens": 0, "prev_request_indexed": None},
        {
            "loss": "routed_away_from_holder",
            "ideal_hit_tokens": 512,
            "hit_tokens": 0,
            "prev_request_indexed": False,
        },
    ]
    out = summarize(records)
    assert out["lost_tokens_by_cause"] == {"routed_away_from_holder": 512}
    assert out["requests_by_cause"] == {"routed_away_from_holder": 1}
    assert out["requests_routed_before_previous_indexed"] == 1


def test_prefix_tokens_must_fill_whole_blocks():
    with pytest.raises(SystemExit):
        routing.parse_args(["--prefix-tokens", "500"])


def test_the_bench_through_the_router_over_standin_pods_reaches_the_ideal(models, tmp_path):
    argv = ["--kinds", "standin,vllm", "--model", str(models.get("llama"))]
    argv += ["--strategies", "prefix+load,round-robin"]  # a stand-in pod ignores cache_salt
    argv += ["--requests", "10", "--tenants", "3", "--prefix-tokens", "128"]
    argv += ["--vllm-venv", str(tmp_path / "no-vllm")]
    out = routing.main(argv)
    standin = out["standin"]
    assert standin["prefix+load"]["ideal_hit_rate"] > 0.5
    assert standin["ours_over_ideal"] >= 0.95, standin["prefix+load"]["trace"]
    assert standin["round_robin_over_ideal"] <= standin["ours_over_ideal"]
    trace = standin["prefix+load"]["trace"]
    assert len(trace["requests"]) == 10
    assert {r["tenant"] for r in trace["requests"]} == {0, 1, 2}
    assert out["vllm"] == {"skipped": f"no vLLM in {tmp_path / 'no-vllm'}"}
