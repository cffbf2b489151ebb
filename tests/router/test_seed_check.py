"""Pods whose events root their hash chains differently (another --hash-seed or hash
algorithm) are counted and named in a warning; routing keeps matching their prefixes."""

from __future__ import annotations

import logging
import time

import httpx

from epdserve.connectors.kv_events import BlockStored, EventBatch
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys
from epdserve.router.metrics import RouterMetrics
from epdserve.router.seedcheck import RootHashCheck

BS = 4
PROMPT = list(range(100, 116))  # 4 blocks of 4
OTHER = list(range(200, 216))
METRIC = "epdserve_router:hash_seed_mismatches_total"


def stored(hashes, parent, tokens, extra=None):
    return BlockStored(list(hashes), parent, list(tokens), BS, None, "GPU", None, extra, 0)


def roots(pod_hashes: dict[str, list[int]], tokens=PROMPT):
    """Index each pod's store of ``tokens`` under its own hashes; the roots it reports."""
    index = PrefixIndex()
    return {
        pod: index.apply(pod, EventBatch(0.0, [stored(h, None, tokens)], 0)).roots
        for pod, h in pod_hashes.items()
    }


def mismatches(metrics: RouterMetrics, pod: str) -> float:
    return metrics.registry.get_sample_value(METRIC, {"pod": pod}) or 0.0


def test_the_index_reports_a_prompts_first_block_as_a_root():
    index = PrefixIndex()
    first = index.apply("a", EventBatch(0.0, [stored([1, 2], None, PROMPT[:8])], 0))
    child = index.apply("a", EventBatch(0.0, [stored([3, 4], 2, PROMPT[8:])], 0))
    assert first.roots == [(request_keys(PROMPT, BS)[0], 1)]
    assert child.roots == []


def test_a_first_block_with_an_image_is_no_root():
    index = PrefixIndex()
    result = index.apply("a", EventBatch(0.0, [stored([1], None, PROMPT[:4], ["mm-1"])], 0))
    assert result.roots == []


def test_one_first_block_under_two_hashes_counts_for_both_pods_and_warns_once(caplog):
    metrics = RouterMetrics()
    check = RootHashCheck(metrics)
    seen = roots({"a": [1, 2, 3, 4], "b": [91, 92, 93, 94]})
    seen_other = roots({"a": [5, 6, 7, 8], "b": [95, 96, 97, 98]}, OTHER)
    with caplog.at_level(logging.WARNING, logger="epdserve.router.seedcheck"):
        for batch in (seen, seen_other):
            check.observe("a", batch["a"])
            check.observe("b", batch["b"])
    assert mismatches(metrics, "a") == 2 and mismatches(metrics, "b") == 2
    (warning,) = caplog.records
    assert "pods a and b" in warning.getMessage() and "--hash-seed" in warning.getMessage()


def test_pods_that_agree_are_never_counted(caplog):
    metrics = RouterMetrics()
    check = RootHashCheck(metrics)
    seen = roots({"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]})
    with caplog.at_level(logging.WARNING):
        check.observe("a", seen["a"])
        check.observe("b", seen["b"])
    assert mismatches(metrics, "a") == 0 and not caplog.records


def test_the_odd_pod_out_counts_most():
    metrics = RouterMetrics()
    check = RootHashCheck(metrics)
    seen = roots({"a": [1, 2, 3, 4], "b": [1, 2, 3, 4], "c": [7, 8, 9, 10]})
    for pod in ("c", "a", "b"):
        check.observe(pod, seen[pod])
    assert [mismatches(metrics, p) for p in "abc"] == [1, 1, 2]


def test_a_pod_that_left_is_forgotten():
    metrics = RouterMetrics()
    check = RootHashCheck(metrics)
    seen = roots({"a": [1, 2, 3, 4], "b": [91, 92, 93, 94]})
    check.observe("a", seen["a"])
    check.forget_pod("a")
    check.observe("b", seen["b"])
    assert mismatches(metrics, "b") == 0


def test_the_check_keeps_at_most_capacity_first_blocks():
    metrics = RouterMetrics()
    check = RootHashCheck(metrics, capacity=1)
    check.observe("a", [(10, 1), (20, 2)])
    check.observe("b", [(10, 9)])  # key 10 was dropped: nothing to compare with
    assert mismatches(metrics, "b") == 0


def wait_metric(spawn, url: str, labels: dict, minimum: float, timeout: float = 20) -> float:
    deadline = time.monotonic() + timeout
    while (value := spawn.metric(url, METRIC, labels)) < minimum:
        assert time.monotonic() < deadline, f"{METRIC}{labels} stayed at {value}"
        time.sleep(0.1)
    return value


def test_real_pods_with_different_hash_seeds_are_detected_and_still_routed(spawn, models):
    model = models.get("llama")
    pods = [spawn.serve(model, "--hash-seed", seed) for seed in ("pool-seed", "other-seed")]
    for pod in pods:
        spawn.wait_ready(pod)
    router = spawn.router(pods, "--model", str(model), "--served-model-name", "tiny")
    body = {"model": "tiny", "prompt": "def main():\n    return 1\n" * 6, "max_tokens": 1}
    for pod in pods:  # the same prompt straight to each pod: the same first block
        assert httpx.post(pod.url + "/v1/completions", json=body, timeout=60).status_code == 200
    for pod in pods:
        wait_metric(spawn, router.url, {"pod": pod.url.removeprefix("http://")}, 1)
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert spawn.metric(router.url, "epdserve_router:requests_total", {"reason": "prefix_hit"})
    log = (spawn.log_dir / f"router-{router.url.rsplit(':', 1)[1]}.log").read_text()
    assert log.count("name the same first KV block differently") == 1
