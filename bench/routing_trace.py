"""Where ``bench/routing.py``'s hits go, request by request (one client at a time).

A shadow index follows the pods' own KV events exactly as the router does (the same
subscriber and index classes, its own sockets), so before each request the bench knows which
pod held the tenant's prefix and whether the previous request's blocks had been indexed yet;
after it, the router's counters say which pod it chose and why and how many blocks it matched,
and the pods' counters how many tokens the chosen engine actually found cached.
"""

from __future__ import annotations

import time
from collections import Counter

from routing_pods import Pod, pod_prefix_counters, router_decisions

from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys
from epdserve.router.metrics import RouterMetrics
from epdserve.router.subscriber import PodSubscriber


class ShadowIndex:
    """The pods' blocks as their events tell them, kept by the bench itself."""

    def __init__(self, pods: list[Pod], block_size: int) -> None:
        self.pods, self.block_size, self.index = pods, block_size, PrefixIndex()
        metrics = RouterMetrics()
        self._subs = [
            PodSubscriber(
                p.name,
                f"tcp://127.0.0.1:{p.events}",
                f"tcp://127.0.0.1:{p.replay}",
                self.index,
                metrics,
            )
            for p in pods
        ]
        for sub in self._subs:
            sub.start()

    def held(self, ids: list[int], salt: str | None = None) -> dict[str, int]:
        """Per pod, how many of the prompt's leading blocks its cache holds."""
        keys = request_keys(ids, self.block_size, cache_salt=salt)
        return self.index.match(keys, [p.name for p in self.pods])

    def wait_for(self, pod: str, ids: list[int], salt: str | None, timeout: float) -> bool:
        """Whether every full block of ``ids`` is indexed on ``pod`` within ``timeout`` s."""
        keys = request_keys(ids, self.block_size, cache_salt=salt)
        deadline = time.monotonic() + timeout
        while self.index.match(keys, [pod])[pod] < len(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        for sub in self._subs:
            sub.stop()


def classify(ideal: int, got: int, held: dict[str, int], chosen: str, bs: int) -> str:
    """Why a request found fewer cached tokens than the affinity oracle's (``ok``: it did not)."""
    if got >= ideal:
        return "ok"
    if held.get(chosen, 0) * bs >= ideal:
        return "engine_missed_indexed_blocks"  # evicted, or the index named other blocks
    if max(held.values(), default=0) > held.get(chosen, 0):
        return "routed_away_from_holder"
    return "prefix_not_indexed_anywhere"  # first on this pod, or events/keys missing


def traced_run(router_url: str, pods: list[Pod], requests, post, bs: int) -> dict:
    """Send ``requests`` (``(tenant, ids, body, ideal_hit_tokens)``) one at a time through
    the router, recording each decision against the shadow index and the engines' counters."""
    shadow = ShadowIndex(pods, bs)
    records, prev = [], None
    try:
        time.sleep(0.5)  # the shadow's subscribers connect and replay
        for i, (tenant, ids, body, ideal) in enumerate(requests):
            prev_indexed = None
            salt = body.get("cache_salt")
            if prev is not None:  # what the router could know when this request came
                prev_indexed = shadow.wait_for(*prev, timeout=0.0)
            held = shadow.held(ids, salt)
            routed0, matched0 = router_decisions(router_url)
            before = {p.name: pod_prefix_counters(p) for p in pods}
            post(body)
            routed1, matched1 = router_decisions(router_url)
            after = {p.name: pod_prefix_counters(p) for p in pods}
            ((chosen, reason),) = [k for k in routed1 if routed1[k] > routed0.get(k, 0.0)]
            got = int(after[chosen][0] - before[chosen][0])
            records.append(
                {
                    "i": i,
                    "tenant": tenant,
                    "pod": chosen,
                    "reason": reason,
                    "router_matched_blocks": int(matched1 - matched0),
                    "indexed_blocks_per_pod": held,
                    "prev_request_indexed": prev_indexed,
                    "ideal_hit_tokens": ideal,
                    "hit_tokens": got,
                    "loss": classify(ideal, got, held, chosen, bs),
                }
            )
            prev = (chosen, ids, salt)
    finally:
        shadow.close()
    return summarize(records)


def summarize(records: list[dict]) -> dict:
    """Lost tokens per cause, and the trace itself."""
    lost: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for r in records:
        if r["loss"] != "ok":
            lost[r["loss"]] += r["ideal_hit_tokens"] - r["hit_tokens"]
            count[r["loss"]] += 1
    late = sum(1 for r in records if r["prev_request_indexed"] is False)
    return {
        "lost_tokens_by_cause": dict(lost),
        "requests_by_cause": dict(count),
        "requests_routed_before_previous_indexed": late,
        "requests": records,
    }
