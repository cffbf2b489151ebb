"""Tier-aware index and scoring: a pod's own cache (local) > the pool's store > a miss."""

from __future__ import annotations

import pytest

from epdserve.connectors.kv_events import (
    STORE_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from epdserve.router.index import LOCAL, STORE, PrefixIndex
from epdserve.router.keys import request_keys
from epdserve.router.metrics import RouterMetrics
from epdserve.router.pods import PodEndpoint
from epdserve.router.service import Router
from epdserve.router.strategy import Candidate, make_strategy

BS = 4
PROMPT = list(range(100, 116))  # 4 blocks of 4
KEYS = request_keys(PROMPT, BS)


def stored(hashes, parent, tokens, medium="GPU"):
    return BlockStored(list(hashes), parent, list(tokens), BS, None, medium, None, None, 0)


def batch(*events):
    return EventBatch(0.0, list(events), 0)


def test_blocks_are_indexed_per_tier():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8])))
    index.apply("a", batch(stored([1, 2, 3], None, PROMPT[:12], STORE_MEDIUM)))
    assert index.pod_block_count("a", LOCAL) == 2
    assert index.pod_block_count("a", STORE) == 3
    assert index.tier_block_counts() == {LOCAL: 2, STORE: 3}
    index.check_integrity()


def test_a_store_block_chains_from_a_parent_the_pod_announced_locally():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8])))
    index.apply("a", batch(stored([3], 2, PROMPT[8:12], STORE_MEDIUM)))
    assert index.match_tiers(KEYS, ["a"]) == {"a": (2, 3)}


def test_store_blocks_are_loadable_by_every_pod():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2, 3], None, PROMPT[:12], STORE_MEDIUM)))
    assert index.match_tiers(KEYS, ["a", "b"]) == {"a": (0, 3), "b": (0, 3)}
    assert index.match(KEYS, ["a", "b"]) == {"a": 0, "b": 0}  # no pod holds them itself


def test_a_local_prefix_continues_into_the_store():
    index = PrefixIndex()
    index.apply("b", batch(stored([5], None, PROMPT[:4])))
    index.apply("a", batch(stored([1, 2, 3, 4], None, PROMPT, STORE_MEDIUM)))
    assert index.match_tiers(KEYS, ["a", "b"]) == {"a": (0, 4), "b": (1, 4)}


def test_removal_with_the_store_medium_leaves_the_local_tier():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8])))
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8], STORE_MEDIUM)))
    index.apply("a", batch(BlockRemoved([2], STORE_MEDIUM, 0)))
    assert index.match_tiers(KEYS, ["a", "b"]) == {"a": (2, 2), "b": (0, 1)}
    index.apply("a", batch(BlockRemoved([2], "GPU", 0)))
    assert index.match_tiers(KEYS, ["a"]) == {"a": (1, 1)}
    index.check_integrity()


def test_clearing_a_pods_cache_keeps_its_store_blocks():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8])))
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8], STORE_MEDIUM)))
    index.apply("a", batch(AllBlocksCleared()))
    assert index.match_tiers(KEYS, ["a"]) == {"a": (0, 2)}


def test_removing_a_pod_drops_both_tiers():
    index = PrefixIndex()
    index.apply("a", batch(stored([1], None, PROMPT[:4]), stored([1], None, PROMPT[:4], "STORE")))
    index.remove_pod("a")
    assert index.tier_block_counts() == {LOCAL: 0, STORE: 0} and len(index) == 0


@pytest.mark.parametrize("name", ["prefix", "prefix+load"])
def test_scoring_prefers_local_then_store_then_miss(name):
    strategy = make_strategy(name)
    pods = [
        Candidate("miss", 0, 0.0, 0, 4),
        Candidate("store", 0, 0.0, 0, 4, store_blocks=4),
        Candidate("local", 0, 0.0, 4, 4),
    ]
    ranked = strategy.rank(pods)
    assert [(d.pod, d.reason) for d in ranked] == [
        ("local", "prefix_hit"),
        ("store", "store_hit"),
        ("miss", "no_prefix"),
    ]


def test_store_weight_above_prefix_weight_is_refused():
    with pytest.raises(ValueError, match="--store-weight"):
        make_strategy("prefix+load", prefix_weight=1.0, store_weight=2.0)


def test_router_labels_a_store_win_and_exports_blocks_per_tier():
    router = Router(make_strategy("prefix+load"), None, metrics=RouterMetrics(), subscribe=False)
    router.default_block_size = BS
    for name in ("a", "b"):
        router.add_pod(PodEndpoint(name, f"http://{name}:8000", "", ""))
    router.index.apply("a", batch(stored([1, 2, 3, 4], None, PROMPT, STORE_MEDIUM)))
    routing = router.route("/v1/completions", {"processed_prompt": {"prompt_token_ids": PROMPT}})
    assert routing.order[0].reason == "store_hit"
    router.record(routing, routing.order[0].pod, 0)
    text = router.metrics.render().decode()
    assert 'epdserve_router:index_blocks{engine_role="colocated",tier="store"} 4.0' in text
    assert 'reason="store_hit"' in text


def test_per_role_routers_sharing_metrics_report_their_own_pods_and_blocks():
    metrics = RouterMetrics()
    prefill, decode = (
        Router(make_strategy("prefix+load"), None, metrics=metrics, subscribe=False, engine_role=r)
        for r in ("prefill", "decode")
    )
    for router, names in ((prefill, ("p0",)), (decode, ("d0", "d1"))):
        for name in names:
            router.add_pod(PodEndpoint(name, f"http://{name}:8000", "", ""))
    prefill.index.apply("p0", batch(stored([1, 2, 3, 4], None, PROMPT, STORE_MEDIUM)))
    prefill.update_index_gauges()
    decode.set_health("d1", False)
    decode.update_index_gauges()  # the decode index is empty: must not hide prefill's blocks
    text = metrics.render().decode()
    assert 'epdserve_router:pods{engine_role="prefill",state="healthy"} 1.0' in text
    assert 'epdserve_router:pods{engine_role="decode",state="healthy"} 1.0' in text
    assert 'epdserve_router:pods{engine_role="decode",state="unhealthy"} 1.0' in text
    assert 'epdserve_router:index_blocks{engine_role="prefill",tier="store"} 4.0' in text
    assert 'epdserve_router:index_blocks{engine_role="decode",tier="store"} 0.0' in text
