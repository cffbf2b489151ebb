"""Stored blocks damaged between the prefill pod's save and the decode pod's load (a bit flipped
in Redis or on disk, cut, padded, swapped, copied under another key, nested 10,000 deep, not
safetensors, an older format): the decode pod answers 200 with exactly the colocated pod's
tokens, recomputing from the first bad block; its engine core is the same process; the bad
values are gone from the store; and each is counted by reason."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from pd_support import BLOCK, answer, greedy, loadable_blocks, post, prompts

from epdserve.common import metrics_text
from epdserve.connectors.storage import create_store

sys.path.insert(0, str(Path(__file__).parents[1] / "connectors" / "storage"))
from raw_values import KV_DAMAGE, RawValues  # noqa: E402

REJECTED = "epdserve:stored_values_rejected_total"
FAILURES = "epdserve:kv_load_failures_total"


def rejected(server, reason: str, kind: str = "kv_block") -> float:
    """One series of the rejection counter (0 before the first rejection of that reason)."""
    body = httpx.get(server.url + "/metrics", timeout=5).text
    return metrics_text.total(body, REJECTED, kind=kind, reason=reason)


@pytest.fixture(params=["redis_pods", "shared_pods"])
def pool(request):
    """``(pods, raw)``: a P/D pair and raw access to the store its pods share."""
    pods = request.getfixturevalue(request.param)
    if request.param == "redis_pods":
        where = {"url": request.getfixturevalue("redis_server").url}
    else:
        where = {"path": str(pods.volume)}
    store = create_store(where)
    raw = RawValues(store)
    yield pods, raw
    raw.close()
    store.close()


@pytest.mark.parametrize("damage", KV_DAMAGE, ids=[d.__name__ for d in KV_DAMAGE])
def test_damaged_blocks_are_recomputed_deleted_and_counted(pool, colocated, damage):
    pods, raw = pool
    prompt = prompts(seed=200 + KV_DAMAGE.index(damage), lengths=(100,))[0]
    body = {**greedy(prompt, 1), "kv_transfer_params": {"do_remote_decode": True}}
    params = post(pods.prefill, body)["kv_transfer_params"]
    keys = [f"epd:kv:{params['pool']}:{params['fingerprint']}:{h}" for h in params["block_hashes"]]
    loadable = len(prompt) // BLOCK  # full blocks (the tail's value follows them)
    assert loadable == 6 and loadable_blocks(prompt) == 7 and all(map(raw.exists, keys))
    bad = damage(raw, keys)
    reasons = sorted(set(bad.values()))
    before = {r: rejected(pods.decode, r) for r in reasons}
    failures0, core = pods.decode.metric(FAILURES), pods.decode.core_pid()

    got = post(pods.decode, {**greedy(prompt), "kv_transfer_params": params})  # asserts 200

    assert answer(got) == answer(post(colocated, greedy(prompt)))
    first_bad = min(bad)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == first_bad * BLOCK
    assert pods.decode.metric(FAILURES) - failures0 == loadable_blocks(prompt) - first_bad
    for reason in reasons:
        counted = sum(r == reason for r in bad.values())
        assert rejected(pods.decode, reason) - before[reason] == counted, reason
    assert [raw.exists(k) for k in keys[:loadable]] == [i not in bad for i in range(loadable)]
    assert pods.decode.core_pid() == core
    # a retry finds the bad blocks gone (plain misses), still exact, nothing counted twice
    again = post(pods.decode, {**greedy(prompt), "kv_transfer_params": params})
    assert answer(again) == answer(got)
    assert all(rejected(pods.decode, r) - before[r] == list(bad.values()).count(r) for r in reasons)
    assert pods.decode.core_pid() == core
