"""The one reader of Prometheus text exposition (a ``/metrics`` page): the router's load
scrape, the operator's autoscaler, benchmarks and tests all read pages through it.

Built on ``prometheus_client``'s parser. Samples keep the names the page shows (a counter's
``_total``, a histogram's ``_bucket``/``_sum``/``_count``), so callers name what they read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families


class Sample(NamedTuple):
    """One line of a page: the sample's name, its labels and its value."""

    name: str
    labels: dict[str, str]
    value: float


Page = str | Iterable[Sample]  # page text, or samples already parsed from it


def parse(text: str, only: Iterable[str] | None = None) -> list[Sample]:
    """Every sample of a page, in order; with ``only``, the samples (and comments) of the
    metric families whose names start with one of those prefixes, so a caller that reads
    three gauges does not parse a pod's every histogram. Raises ``ValueError`` on a
    malformed page (in the part it reads)."""
    if only is not None:
        text = _only(text, tuple(only))
    return [
        Sample(s.name, s.labels, float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _only(text: str, prefixes: tuple[str, ...]) -> str:
    kept = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("#") and line.count(" ") >= 2 else line
        if name.startswith(prefixes):
            kept.append(line)
    return "\n".join(kept) + "\n"


def _samples(page: Page) -> Iterable[Sample]:
    return parse(page) if isinstance(page, str) else page


def values(page: Page, name: str, **labels: str) -> list[float]:
    """Values of the samples named ``name`` whose labels include ``labels``."""
    return [
        s.value
        for s in _samples(page)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(page: Page, name: str, **labels: str) -> float:
    """Sum of :func:`values` (0.0 when the page has no such sample)."""
    return sum(values(page, name, **labels))


def buckets(page: Page, family: str, **labels: str) -> dict[float, float]:
    """Cumulative bucket counts of histogram ``family`` by upper bound (``+Inf`` as inf),
    summed over the label sets that include ``labels``."""
    out: dict[float, float] = {}
    for s in _samples(page):
        if s.name != family + "_bucket" or "le" not in s.labels:
            continue
        if all(s.labels.get(k) == v for k, v in labels.items()):
            bound = float(s.labels["le"])  # "+Inf" parses to inf
            out[bound] = out.get(bound, 0.0) + s.value
    return out
