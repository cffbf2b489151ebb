"""``prefix+cost``: pods ranked by the prefill work ahead of a request's first token, from the
router's own backlog count; and the per-decision metrics every strategy records."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from epdserve.connectors.kv_events import STORE_MEDIUM, BlockStored, EventBatch
from epdserve.router.metrics import RouterMetrics
from epdserve.router.pods import PodEndpoint
from epdserve.router.service import Router
from epdserve.router.strategy import Candidate, make_strategy, uncached_tokens

BS = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks of 4 and one token


def cand(name, matched=0, store=0, backlog=0.0, decoding=0, tokens=len(PROMPT), load=0):
    return Candidate(name, load, 0.0, matched, 4, 0, store, 0, tokens, BS, float(backlog), decoding)


def test_uncached_tokens_counts_local_store_and_computed_tokens():
    assert uncached_tokens(17, BS, 0, 0, 0.1) == 17
    assert uncached_tokens(17, BS, 4, 0, 0.1) == 1
    assert uncached_tokens(17, BS, 2, 2, 0.5) == pytest.approx(9 - 8 + 0.5 * 8)
    assert uncached_tokens(17, BS, 9, 9, 0.1) == 0  # more blocks than tokens: clamped


def test_a_prefix_hit_wins_on_idle_pods():
    ranked = make_strategy("prefix+cost").rank([cand("miss"), cand("hit", matched=4)])
    assert [(d.pod, d.reason) for d in ranked] == [("hit", "prefix_hit"), ("miss", "no_prefix")]


def test_a_hot_pod_keeps_its_prefix_until_its_queue_costs_more_than_a_recompute():
    strategy = make_strategy("prefix+cost", store_cost=0.1, decode_cost=0.0, recompute_cost=0)
    # the hit costs 1 token; a recompute elsewhere costs 17
    assert strategy.rank([cand("hot", 4, backlog=15), cand("cold")])[0].pod == "hot"
    ranked = strategy.rank([cand("hot", 4, backlog=17), cand("cold")])
    assert [(d.pod, d.reason) for d in ranked] == [("cold", "spread"), ("hot", "spread")]
    # counting the wait a recompute adds behind it (x2): 17 queued is not yet enough
    sticky = make_strategy("prefix+cost", decode_cost=0.0, recompute_cost=1.0)
    assert sticky.rank([cand("hot", 4, backlog=17), cand("cold")])[0].pod == "hot"
    assert sticky.rank([cand("hot", 4, backlog=33), cand("cold")])[0].pod == "cold"


def test_a_store_copy_spreads_a_hot_prefix_sooner():
    strategy = make_strategy("prefix+cost", store_cost=0.1, decode_cost=0.0, recompute_cost=0)
    store = cand("warm", store=4)  # 16 tokens loaded at 0.1 + 1 computed = 2.6
    assert strategy.rank([cand("hot", 4, backlog=1), store])[0].pod == "hot"
    assert strategy.rank([cand("hot", 4, backlog=2), store])[0].pod == "warm"


def test_decoding_requests_count_and_unknown_prompts_go_by_backlog():
    strategy = make_strategy("prefix+cost", decode_cost=2.0)
    assert strategy.rank([cand("a", decoding=3), cand("b", backlog=5)])[0].pod == "b"
    unknown = [cand("a", tokens=0, backlog=40), cand("b", tokens=0, backlog=3)]
    assert strategy.rank(unknown)[0].pod == "b"


def test_bad_costs_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--store-cost"):
        make_strategy("prefix+cost", store_cost=1.5)
    with pytest.raises(ValueError, match="--decode-cost"):
        make_strategy("prefix+cost", decode_cost=-1)
    with pytest.raises(ValueError, match="--recompute-cost"):
        make_strategy("prefix+cost", recompute_cost=-0.5)


def router_with(names, strategy="prefix+cost"):
    router = Router(make_strategy(strategy), None, metrics=RouterMetrics(), subscribe=False)
    router.default_block_size = BS
    for name in names:
        router.add_pod(PodEndpoint(name, f"http://{name}:8000", "", ""))
    return router


def stored(hashes, tokens, medium="GPU"):
    return BlockStored(list(hashes), None, list(tokens), BS, None, medium, None, None, 0)


BODY = {"processed_prompt": {"prompt_token_ids": PROMPT}}


def test_routing_charges_the_first_pod_so_a_burst_spreads_and_release_drains_it():
    router = router_with(["a", "b"])
    router.index.apply("a", EventBatch(0.0, [stored([1, 2, 3, 4], PROMPT[:16])], 0))
    a, b = router.pod("a"), router.pod("b")
    # a hit on a costs 1.5 (1 token and the wait it adds), a recompute on b 1.5 x 17
    burst = [router.route("/v1/completions", BODY) for _ in range(25)]  # 1 token each on a
    assert [r.order[0].pod for r in burst] == ["a"] * 25
    assert (a.prefilling, a.prefill_tokens) == (25, 25)
    spilled = router.route("/v1/completions", BODY)  # 25 + 1.5 on a against 25.5 on b
    assert spilled.order[0].pod == "b" and b.prefill_tokens == len(PROMPT)
    spilled.charge.move_to(a, spilled)  # the attempt went to a after all: a pays 1 token
    assert (b.prefilling, b.prefill_tokens, a.prefill_tokens) == (0, 0, 26)
    for routing in [*burst, spilled]:
        routing.charge.release()
        routing.charge.release()  # idempotent
    assert (a.prefilling, a.prefill_tokens) == (0, 0.0)
    last = router.route("/v1/completions", BODY)
    assert last.order[0].pod == "a"
    text = router.metrics.render().decode()
    assert 'epdserve_router:prefill_backlog_tokens{pod="a"} 1.0' in text


def test_a_dropped_routing_releases_its_charge():
    import gc

    router = router_with(["a"])
    router.route("/v1/completions", BODY)  # never sent anywhere
    gc.collect()
    assert (router.pod("a").prefilling, router.pod("a").prefill_tokens) == (0, 0.0)


def metric(router, name, **labels):
    from epdserve.common import metrics_text

    return metrics_text.total(router.metrics.render().decode(), name, **labels)


def test_each_decision_is_counted_by_tier_best_prefix_and_spread_reason():
    router = router_with(["a", "b", "c"])
    router.index.apply("a", EventBatch(0.0, [stored([1, 2, 3, 4], PROMPT[:16])], 0))
    router.index.apply("b", EventBatch(0.0, [stored([1, 2], PROMPT[:8], STORE_MEDIUM)], 0))
    routing = router.route("/v1/completions", BODY)
    router.record(routing, "a", 0)  # the best pod
    router.record(routing, "b", 1)  # a retry to a store pod
    router.record(routing, "c", 0)  # chosen elsewhere first: the strategy's cost
    name = "epdserve_router:decision_blocks_total"
    assert metric(router, name, tier="local") == 4
    assert metric(router, name, tier="store") == 2 + 2  # the store counts for every pod
    assert metric(router, name, tier="miss") == 2 + 2
    best = "epdserve_router:decision_best_prefix_total"
    assert (metric(router, best, choice="best"), metric(router, best, choice="other")) == (1, 2)
    spread = "epdserve_router:spread_decisions_total"
    assert metric(router, spread, reason="retry") == 1
    assert metric(router, spread, reason="score") == 1  # the first choice was a prefix hit
    other = router_with(["x"], "round-robin")
    other.record(other.route("/v1/completions", BODY), "x", 0)
    assert metric(other, best, choice="none") == 1


def test_prefix_load_spill_counts_as_balance():
    router = router_with(["a", "b"], "prefix+load")
    router.index.apply("a", EventBatch(0.0, [stored([1, 2, 3, 4], PROMPT[:16])], 0))
    router.pod("a").inflight = 10  # past --balance-threshold
    routing = router.route("/v1/completions", BODY)
    assert routing.order[0] == routing.order[0].__class__("b", "load_balance")
    router.record(routing, "b", 0)
    assert metric(router, "epdserve_router:spread_decisions_total", reason="balance") == 1


@pytest.fixture
def model_dir(models):
    return models.get("llama")


def test_the_real_router_spreads_a_hot_prefix_and_its_backlog_drains(spawn, model_dir):
    """Through ``epdserve router --strategy prefix+cost`` and two stand-in pods that take
    0.05 s per uncached block: twelve concurrent requests with one long shared prefix (~400
    tokens) and long private tails (~100) do not all queue on the pod that holds the prefix
    (four tails there cost as much as the whole prompt elsewhere), every decision is counted, and once they finish the
    router's backlog of each pod is back to zero."""
    pods = [spawn.standin(model_dir, prefill_s_per_block=0.05) for _ in range(2)]
    router = spawn.router(pods, "--strategy", "prefix+cost", "--model", str(model_dir))
    prefix = " ".join(["alpha beta gamma delta"] * 40)
    body = {"model": "tiny", "prompt": prefix + " warm", "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 200
    warmed = {p.url: spawn.metric(p.url, "vllm:prefix_cache_queries_total") for p in pods}
    assert sorted(warmed.values())[0] == 0  # one pod holds the prefix

    def one(i: int) -> int:
        tail = " ".join(["kernel tensor block cache"] * 12)  # ~100 tokens to compute anywhere
        body = {"model": "tiny", "prompt": f"{prefix} {i} {tail}", "max_tokens": 2}
        return httpx.post(router.url + "/v1/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(12) as pool:
        assert list(pool.map(one, range(12))) == [200] * 12
    served = {p.url: spawn.metric(p.url, "vllm:prefix_cache_queries_total") for p in pods}
    assert all(served[u] > warmed[u] for u in served)  # the hot prefix went to both pods
    name = "epdserve_router:decision_best_prefix_total"
    assert spawn.metric(router.url, name) == 13
    assert spawn.metric(router.url, "epdserve_router:spread_decisions_total", {"reason": "cost"})
    assert spawn.metric(router.url, "epdserve_router:prefill_backlog_tokens") == 0


@pytest.mark.parametrize("strategy", ["prefix", "prefix+load", "prefix+cost"])
def test_requests_of_a_new_prefix_routed_at_once_go_to_one_pod(strategy):
    """Routed before either is sent (no events, no send yet): the first's pod counts as
    holding the prefix for the second."""
    router = router_with(["a", "b", "c"], strategy)
    long = {"processed_prompt": {"prompt_token_ids": list(range(200, 264)) + [7]}}
    first = router.route("/v1/completions", long)
    second = router.route("/v1/completions", long)
    assert second.order[0].pod == first.order[0].pod
    assert second.matched[first.order[0].pod] == 16
