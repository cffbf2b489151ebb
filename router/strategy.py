"""Routing strategies: pick a pod from candidates with prefix matches and load."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One pod as a strategy sees it."""

    name: str
    load: float  # in-flight / queued requests
    kv_usage: float  # 0..1
    matched_blocks: int  # consecutive prefix blocks cached on the pod
    total_blocks: int  # full blocks in the prompt
    cached_blocks: int = 0  # blocks the index holds for the pod (emptier caches evict less)
    store_blocks: int = 0  # blocks after the local match the pod can load from the store
    affinity: int = 0  # the request's images' rendezvous weight for the pod (0: no images)
    prompt_tokens: int = 0  # the prompt's length (0: unknown)
    block_size: int = 0  # the pod's
    prefill_backlog: float = 0.0  # tokens of requests sent to the pod still before their first
    decoding: int = 0  # requests sent to the pod past their first token

    @property
    def prefix_fraction(self) -> float:
        return self.matched_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def store_fraction(self) -> float:
        return self.store_blocks / self.total_blocks if self.total_blocks else 0.0

    def uncached_tokens(self, store_cost: float) -> float:
        """Prompt tokens the pod must compute, a store-loaded one counting ``store_cost``."""
        return uncached_tokens(
            self.prompt_tokens, self.block_size, self.matched_blocks, self.store_blocks, store_cost
        )


def uncached_tokens(
    tokens: int, block_size: int, local: int, store: int, store_cost: float
) -> float:
    """``tokens`` less the ``local`` cached blocks, with the ``store`` blocks after them at
    ``store_cost`` of a computed token each."""
    hit = min(tokens, local * block_size)
    loaded = min(tokens - hit, store * block_size)
    return tokens - hit - loaded + store_cost * loaded


@dataclass(frozen=True)
class Decision:
    """The chosen pod and why (the ``reason`` label of the requests metric)."""

    pod: str
    reason: str


class Strategy:
    """Orders candidates best first; the proxy tries them in that order."""

    name = ""
    uses_prefix = False  # candidates carry prefix matches (the router tokenizes for them)
    uses_images = False  # candidates carry image affinity

    def rank(self, candidates: list[Candidate]) -> list[Decision]:
        """All candidates, best first (never empty when candidates is not)."""
        raise NotImplementedError


class RoundRobin(Strategy):
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, candidates: list[Candidate]) -> list[Decision]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda c: c.name)
        start = next(self._counter) % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return [Decision(c.name, "round_robin") for c in rotated]


class _Tiebreak:
    """Rotates among equally good pods so ties spread instead of piling on one."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def key(self, candidates: list[Candidate]) -> dict[str, int]:
        names = sorted(c.name for c in candidates)
        start = next(self._counter) % max(1, len(names))
        return {n: (i - start) % len(names) for i, n in enumerate(names)}


class LeastLoad(Strategy):
    name = "least-load"

    def __init__(self) -> None:
        self._tiebreak = _Tiebreak()

    def rank(self, candidates: list[Candidate]) -> list[Decision]:
        tie = self._tiebreak.key(candidates)
        ordered = sorted(candidates, key=lambda c: (c.load, c.kv_usage, tie[c.name]))
        return [Decision(c.name, "least_load") for c in ordered]


class ImageAffinity(Strategy):
    """Encoder pods: rendezvous hashing over the request's images, so a repeated image goes
    where its encoder output is stored, and the next pods in the same fixed order take it
    when that one refuses. A request without images goes to the least loaded pod."""

    name = "image-affinity"
    uses_images = True

    def __init__(self) -> None:
        self._least_load = LeastLoad()

    def rank(self, candidates: list[Candidate]) -> list[Decision]:
        if not any(c.affinity for c in candidates):
            return self._least_load.rank(candidates)
        ordered = sorted(candidates, key=lambda c: (-c.affinity, c.name))
        return [Decision(c.name, "encoder_affinity") for c in ordered]


class Prefix(Strategy):
    """Precise prefix affinity: the longest cached prefix wins; load breaks ties."""

    name = "prefix"
    uses_prefix = True

    def __init__(self) -> None:
        self._tiebreak = _Tiebreak()

    def rank(self, candidates: list[Candidate]) -> list[Decision]:
        tie = self._tiebreak.key(candidates)
        ordered = sorted(
            candidates,
            key=lambda c: (
                -c.matched_blocks,
                -c.store_blocks,
                c.load,
                c.cached_blocks,
                tie[c.name],
            ),
        )
        return [Decision(c.name, _reason(c)) for c in ordered]


class PrefixLoad(Strategy):
    """Weighted score: prefix fraction against relative queue depth and KV usage (the shape
    of llm-d's precise-prefix + load-aware + kv-utilization scorers), with a balance guard
    (as SGLang's cache-aware router): pods more than ``balance_threshold`` requests busier
    than the least busy one are only tried after the others, so a hot prefix spills.
    Blocks a pod can load from the pool's shared store count with ``store_weight``, below
    ``prefix_weight``: a load is cheaper than a recompute, dearer than a local hit."""

    name = "prefix+load"
    uses_prefix = True

    def __init__(
        self,
        prefix_weight: float = 2.0,
        load_weight: float = 1.0,
        kv_weight: float = 0.5,
        balance_threshold: float = 4.0,
        store_weight: float = 1.0,
    ):
        if not 0 <= store_weight <= prefix_weight:
            raise ValueError("--store-weight must be between 0 and --prefix-weight")
        self.weights = (prefix_weight, load_weight, kv_weight)
        self.store_weight = store_weight
        self.balance_threshold = balance_threshold
        self._tiebreak = _Tiebreak()

    def score(self, c: Candidate, max_load: float) -> float:
        """Higher is better."""
        wp, wl, wk = self.weights
        load = 1.0 - (c.load / max_load if max_load > 0 else 0.0)
        prefix = wp * c.prefix_fraction + self.store_weight * c.store_fraction
        return prefix + wl * load + wk * (1.0 - min(1.0, max(0.0, c.kv_usage)))

    def rank(self, candidates: list[Candidate]) -> list[Decision]:
        if not candidates:
            return []
        tie = self._tiebreak.key(candidates)
        max_load = max(c.load for c in candidates)
        min_load = min(c.load for c in candidates)
        ordered = sorted(
            candidates,
            key=lambda c: (-self.score(c, max_load), c.load, c.cached_blocks, tie[c.name]),
        )
        within = [c for c in ordered if c.load - min_load <= self.balance_threshold]
        spilled = within[0] is not ordered[0]
        ordered = within + [c for c in ordered if c.load - min_load > self.balance_threshold]
        return [Decision(c.name, "load_balance" if spilled else _reason(c)) for c in ordered]


class PrefixCost(Strategy):
    """Least estimated work before the first token, in prompt tokens to compute: what the
    pod still has to prefill for requests already sent to it (the router's own count, so it
    is current to the request, unlike a scrape), plus this request's uncached tokens there
    (a block loadable from the pool's shared store counts ``store_cost`` of a computed one),
    plus ``decode_cost`` per request the pod is decoding (each adds its token to every step).
    A hot prefix stays on its pod while the queue there costs less than a recompute
    elsewhere, and spreads to other pods once it costs more; with a shared store the extra
    pods load the prefix rather than compute it, so it spreads sooner."""

    name = "prefix+cost"
    uses_prefix = True

    def __init__(
        self, store_cost: float = 0.1, decode_cost: float = 2.0, recompute_cost: float = 0.5
    ) -> None:
        if not 0 <= store_cost <= 1:
            raise ValueError("--store-cost must be between 0 and 1")
        for flag, value in (("--decode-cost", decode_cost), ("--recompute-cost", recompute_cost)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0")
        self.store_cost, self.decode_cost = store_cost, decode_cost
        self.recompute_cost = recompute_cost
        self._tiebreak = _Tiebreak()

    def cost(self, c: Candidate) -> float:
        """Lower is better. The request's own work counts ``1 + recompute_cost`` times: once
        for its wait, and again for the wait it adds for the requests behind it there."""
        work = c.uncached_tokens(self.store_cost) if c.prompt_tokens else 0.0
        own = (1.0 + self.recompute_cost) * work
        return c.prefill_backlog + own + self.decode_cost * c.decoding

    def rank(self, candidates: list[Candidate]) -> list[Decision]:
        if not candidates:
            return []
        tie = self._tiebreak.key(candidates)
        ordered = sorted(
            candidates,
            key=lambda c: (self.cost(c), -c.matched_blocks, c.load, c.cached_blocks, tie[c.name]),
        )
        best = max(c.matched_blocks for c in candidates)
        spread = best > ordered[0].matched_blocks
        return [Decision(c.name, "spread" if spread else _reason(c)) for c in ordered]


def _reason(c: Candidate) -> str:
    """The tier that won: the pod's own cache, the shared store, or neither."""
    if c.matched_blocks:
        return "prefix_hit"
    return "store_hit" if c.store_blocks else "no_prefix"


STRATEGIES = {
    "round-robin": RoundRobin,
    "least-load": LeastLoad,
    "prefix": Prefix,
    "prefix+load": PrefixLoad,
    "prefix+cost": PrefixCost,
}


def make_strategy(name: str, **weights: float) -> Strategy:
    """The strategy class registered under ``name`` (``--strategy``)."""
    if name not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {sorted(STRATEGIES)}, got {name!r}")
    if name in ("prefix+load", "prefix+cost"):
        return STRATEGIES[name](**weights)
    return STRATEGIES[name]()
