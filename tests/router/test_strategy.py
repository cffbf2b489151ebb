"""Strategies rank candidates as documented; load parsing of vLLM's /metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from epdserve.router.loadstats import parse_load
from epdserve.router.pods import PodEndpoint
from epdserve.router.strategy import Candidate, Decision, make_strategy

# the reference captures live beside the checkout: <project root>/../shared/testdata
CAPTURES = Path(__file__).resolve().parents[2].parent / "shared" / "testdata" / "vllm-0.32"


def cand(name, load=0.0, kv=0.0, matched=0, total=10):
    return Candidate(name, load, kv, matched, total)


def first(strategy, candidates):
    return strategy.rank(candidates)[0]


def test_round_robin_cycles_through_every_pod():
    rr = make_strategy("round-robin")
    pods = [cand("a"), cand("b"), cand("c")]
    assert [first(rr, pods).pod for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_load_prefers_the_shortest_queue():
    assert first(make_strategy("least-load"), [cand("a", 3), cand("b", 1), cand("c", 2)]).pod == "b"


def test_prefix_prefers_the_longest_match_whatever_the_load():
    decision = first(make_strategy("prefix"), [cand("a", 9, matched=8), cand("b", 0, matched=2)])
    assert decision.pod == "a" and decision.reason == "prefix_hit"


def test_prefix_load_keeps_a_full_match_on_a_busy_pod():
    s = make_strategy("prefix+load")
    assert first(s, [cand("a", 4, matched=10), cand("b", 0)]).pod == "a"


def test_prefix_load_spills_a_partial_match_off_an_overloaded_pod():
    s = make_strategy("prefix+load")
    assert first(s, [cand("a", 8, matched=3), cand("b", 0)]).pod == "b"


def test_prefix_load_spreads_ties_and_says_why():
    s = make_strategy("prefix+load")
    picks = {first(s, [cand("a"), cand("b"), cand("c")]) for _ in range(6)}
    assert {d.pod for d in picks} == {"a", "b", "c"}
    assert {d.reason for d in picks} == {"no_prefix"}


def test_every_candidate_is_ranked_for_retries():
    for name in ("round-robin", "least-load", "prefix", "prefix+load"):
        assert sorted(d.pod for d in make_strategy(name).rank([cand("a"), cand("b")])) == ["a", "b"]


def test_unknown_strategy_is_rejected_by_name():
    with pytest.raises(ValueError, match="--strategy"):
        make_strategy("random")


def test_parse_load_reads_vllms_gauges():
    capture = CAPTURES / "metrics.txt"
    if not capture.exists():
        pytest.skip("vLLM capture not present")
    load = parse_load(capture.read_text())
    assert set(load) == {"running", "waiting", "kv_usage"}
    assert 0.0 <= load["kv_usage"] <= 1.0


def test_parse_load_sums_engines_and_averages_kv_usage():
    text = (
        '# HELP x\nvllm:num_requests_waiting{engine="0"} 2.0\nvllm:num_requests_waiting{engine="1"} 3.0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.4\n'
        "vllm:num_requests_running 1.0 1700000000\nvllm:num_requests_running_bogus 9\n"
    )
    assert parse_load(text) == {"waiting": 5.0, "kv_usage": pytest.approx(0.3), "running": 1.0}


def test_parse_load_refuses_a_page_that_is_not_metrics():
    with pytest.raises(ValueError):
        parse_load("<html>busy</html>\n")


def test_endpoint_flag_follows_the_port_convention_and_overrides():
    ep = PodEndpoint.parse("http://10.1.2.3:8000", 5557, 5558)
    assert (ep.events, ep.replay) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    ep = PodEndpoint.parse("http://127.0.0.1:8001,events=6001,replay=none", 5557, 5558)
    assert (ep.events, ep.replay) == ("tcp://127.0.0.1:6001", None)


@pytest.mark.parametrize("spec", ["ftp://x:1", "http://nohost", "http://h:1,color=red"])
def test_bad_endpoint_flags_name_the_flag(spec):
    with pytest.raises(ValueError, match="--endpoint"):
        PodEndpoint.parse(spec, 5557, 5558)


def test_a_new_prefix_goes_to_the_pod_with_the_emptiest_cache():
    for name in ("prefix", "prefix+load"):
        s = make_strategy(name)
        pods = [
            Candidate("a", 0, 0, 0, 10, 30),
            Candidate("b", 0, 0, 0, 10, 0),
            Candidate("c", 0, 0, 0, 10, 12),
        ]
        assert [first(s, pods).pod for _ in range(3)] == ["b", "b", "b"]


def test_prefix_load_spills_a_hot_prefix_past_the_balance_threshold():
    s = make_strategy("prefix+load", balance_threshold=2)
    assert first(s, [cand("a", 2, matched=10), cand("b", 0)]).pod == "a"
    decision = first(s, [cand("a", 3, matched=10), cand("b", 0)])
    assert decision == Decision("b", "load_balance")
    assert [d.pod for d in s.rank([cand("a", 3, matched=10), cand("b", 0)])] == ["b", "a"]
