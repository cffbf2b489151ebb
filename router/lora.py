"""Adapter-aware routing (LoRA): what the router knows of each pod's adapters, and the pure
rules that place a request for an adapter. The requests themselves are in ``lora_route``.

What a pod holds (``PodAdapters``) comes from two pages the load scrape reads: the
``vllm:lora_requests_info`` gauge at every scrape (its ``max_lora`` and the adapters of its
running and waiting requests; vLLM keeps one sample per label set it ever had, so the newest
one, the largest timestamp, is the pod's state now), and ``/v1/models`` (the base model first,
then one entry per loaded adapter, with ``parent``) every ``list_interval`` seconds, and at
once when the gauge names an adapter the list lacks (the gauge's names are comma-joined: the
list tells a vLLM pod's adapter ``a,b`` from ``a`` and ``b``). Only pods that export the gauge are
listed, or every pod when the router is configured for adapters.

A request whose ``model`` names an adapter goes, in this order, to:

1. the pods that hold it, in the strategy's order (prefix, then load);
2. with dynamic loading and a source for the adapter, when no pod holds it: the pod the
   adapter is loaded on (``load_order``: a free slot first, then the fewest adapters, then
   the least load, then the name), the next one when a load fails;
3. the pods whose list is not known yet (they may hold it).

Pods known not to hold it are never tried: with none of 1-3 the router answers 404 as a pod
would. Replicas of a hot adapter spread (``spread_target``): when every holder's load (the
strategy's: in-flight or queued requests) is at least ``spread_load``, and a pod with a free
slot has less, the adapter is loaded there too and the request goes there first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from epdserve.common import metrics_text

LORA_INFO = "vllm:lora_requests_info"
MAX_ADAPTERS = 4096  # names read from one pod's page or list (a bound, not a limit pods have)
MAX_NAME = 512


@dataclass(frozen=True)
class PodAdapters:
    """One pod's adapters as last seen; replaced whole, never changed (routing threads read it)."""

    max_lora: int = 0  # device slots (the gauge's label); 0: the pod exports no gauge
    running: frozenset[str] = frozenset()  # adapters of its running and waiting requests
    listed: frozenset[str] | None = None  # adapters its /v1/models lists (None: not read yet)
    base: str | None = None  # its base model's id
    listed_at: float = 0.0  # monotonic time of the last list

    @property
    def enabled(self) -> bool:
        """The pod serves adapters (exports the gauge, or lists one)."""
        return self.max_lora > 0 or bool(self.listed)

    @property
    def known(self) -> bool:
        return self.listed is not None

    def holds(self, name: str) -> bool:
        return name in self.running or (self.listed is not None and name in self.listed)

    def count(self) -> int:
        return len(self.running | (self.listed or frozenset()))

    def has_free_slot(self) -> bool:
        return self.enabled and self.count() < max(self.max_lora, 1)

    def with_loaded(self, name: str) -> PodAdapters:
        return dataclasses.replace(self, listed=(self.listed or frozenset()) | {name})


@dataclass(frozen=True)
class AdapterPolicy:
    """The router's adapter settings (``RouterConfig.adapter_policy``)."""

    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> path on pods
    dynamic: bool = False  # load adapters on pods (POST /v1/load_lora_adapter)
    spread_load: float = 4.0
    list_interval: float = 5.0
    load_timeout: float = 120.0
    retry_s: float = 10.0  # a pod whose load failed is not asked again for that long
    api_key: str | None = dataclasses.field(default=None, repr=False)  # the pods' (shared)

    @property
    def configured(self) -> bool:
        return self.dynamic or bool(self.sources)

    def loadable(self, name: str) -> bool:
        return self.dynamic and name in self.sources


def parse_modules(items: list[str]) -> dict[str, str]:
    """``--lora-modules`` items (``name=path`` or ``{"name": ..., "path": ...}``) as a map;
    ValueError naming the flag."""
    out: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                data = json.loads(item)
            except ValueError:
                data = None
            name = data.get("name") if isinstance(data, dict) else None
            path = data.get("path") if isinstance(data, dict) else None
        else:
            name, sep, path = item.partition("=")
            name, path = (name.strip(), path.strip()) if sep else (None, None)
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: NAME=PATH or a JSON object, got {item!r}")
        if "," in name:  # the pods' lora_requests_info gauge joins names with commas
            raise ValueError(f"--lora-modules: an adapter name cannot hold a comma: {name!r}")
        if name in out:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        out[name] = path
    return out


def parse_lora_info(
    text: str, listed: frozenset[str] | None = None
) -> tuple[int, frozenset[str]] | None:
    """``(max_lora, adapters of running and waiting requests)`` from a /metrics page, from
    its newest sample; None when the page has no such gauge. ValueError: malformed page.
    ``listed``: the pod's adapters, which tell a name with a comma from two names."""
    if LORA_INFO not in text:  # most pods: no adapters, no parse
        return None
    samples = [s for s in metrics_text.parse(text, only=(LORA_INFO,)) if s.name == LORA_INFO]
    if not samples:
        return None
    latest = max(samples, key=lambda s: s.value)
    try:
        max_lora = max(0, int(latest.labels.get("max_lora", "0")))
    except ValueError:
        max_lora = 0
    names: set[str] = set()
    for label in ("running_lora_adapters", "waiting_lora_adapters"):
        joined = latest.labels.get(label, "")
        names.update(n for n in split_names(joined, listed) if 0 < len(n) <= MAX_NAME)
    return max_lora, frozenset(sorted(names)[:MAX_ADAPTERS])


def split_names(joined: str, listed: frozenset[str] | None) -> list[str]:
    """The adapter names of one of the gauge's labels. vLLM joins them with ',' and takes
    names with commas (ours refuse them), so ``a,b`` may be one adapter: a run of pieces that
    joins to a name the pod lists is that one name, the longest run first; other pieces are
    names of their own (all of them, while the pod's list is not known)."""
    pieces = joined.split(",")
    widest = max((n.count(",") + 1 for n in listed or () if "," in n), default=1)
    if widest == 1:
        return pieces
    names, i = [], 0
    while i < len(pieces):
        runs = range(min(len(pieces), i + widest), i + 1, -1)
        end = next((j for j in runs if ",".join(pieces[i:j]) in listed), i + 1)
        names.append(",".join(pieces[i:end]))
        i = end
    return names


def parse_models(data) -> tuple[str | None, frozenset[str]]:
    """``(base model id, adapter ids)`` of a ``/v1/models`` answer; ValueError if not one."""
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError("not an OpenAI model list")
    base, adapters = None, set()
    for entry in entries[:MAX_ADAPTERS]:
        name = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            continue
        if entry.get("parent") is None:
            base = base or name
        else:
            adapters.add(name)
    return base, frozenset(adapters)


def split(order: list[str], views: dict[str, PodAdapters], lora: str):
    """``(holders, unknown, others)``: the ranked pod names split by what they hold, each
    list in the strategy's order."""
    holders, unknown, others = [], [], []
    for name in order:
        view = views[name]
        group = holders if view.holds(lora) else unknown if not view.known else others
        group.append(name)
    return holders, unknown, others


def load_order(names: list[str], views: dict[str, PodAdapters], loads: dict[str, float]):
    """Pods an adapter may be loaded on, best first: those serving adapters, a free slot
    first, then the fewest adapters, then the least load, then the name."""
    enabled = [n for n in names if views[n].enabled]
    return sorted(
        enabled, key=lambda n: (not views[n].has_free_slot(), views[n].count(), loads[n], n)
    )


def spread_target(
    holders: list[str],
    others: list[str],
    views: dict[str, PodAdapters],
    loads: dict[str, float],
    spread_load: float,
) -> str | None:
    """The pod a hot adapter also goes to: when every holder has at least ``spread_load``
    requests, the first of ``load_order(others)`` with a free slot and less load (None: no
    spread)."""
    if not holders or any(loads[n] < spread_load for n in holders):
        return None
    for name in load_order(others, views, loads):
        if views[name].has_free_slot() and loads[name] < spread_load:
            return name
    return None


class LoadFailed(Exception):
    """A pod did not load an adapter (the message says why)."""


class AdapterLoads:
    """Loads in flight, one per (pod, adapter): concurrent requests wait for the same one.
    A pod whose load failed is not asked again for ``retry_s``. Event-loop use only."""

    def __init__(self, retry_s: float = 10.0) -> None:
        self.retry_s = retry_s
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._failed: dict[tuple[str, str], tuple[float, str]] = {}
        self.waiters: dict[tuple[str, str], int] = {}  # requests waiting on each load

    def recent_failure(self, pod: str, lora: str) -> str | None:
        """Why the last load of ``lora`` on ``pod`` failed, within ``retry_s`` (else None)."""
        until, why = self._failed.get((pod, lora), (0.0, ""))
        return why if time.monotonic() < until else None

    async def load(self, pod: str, lora: str, start: Callable[[], Awaitable[None]]) -> None:
        """Run ``start()`` unless a load of ``lora`` on ``pod`` is in flight already; wait
        for it either way. Raises LoadFailed."""
        key = (pod, lora)
        task = self._inflight.get(key)
        if task is None:
            task = self._inflight[key] = asyncio.ensure_future(self._run(key, start))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
        self.waiters[key] = self.waiters.get(key, 0) + 1
        try:
            await asyncio.shield(task)  # one client going away does not stop the others' load
        finally:
            self.waiters[key] -= 1
            if not self.waiters[key]:
                del self.waiters[key]

    async def _run(self, key: tuple[str, str], start) -> None:
        try:
            await start()
        except LoadFailed as exc:
            self._failed[key] = (time.monotonic() + self.retry_s, str(exc))
            raise
        finally:
            self._inflight.pop(key, None)
        self._failed.pop(key, None)
