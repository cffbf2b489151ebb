"""``bench/grammar_cost.py`` grows each family to the largest size the API accepts (no
compiles: the measurement itself is the bench's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import grammar_cost as bench  # noqa: E402

OPTIONAL = [name for name in bench.FAMILIES if "optional" in name]


@pytest.mark.parametrize("name", OPTIONAL)
def test_each_optional_family_is_grown_to_the_bound_and_one_more_is_refused(name):
    family = bench.FAMILIES[name]
    size = bench.largest_passing(family, hi=2048)
    assert size > 0 and bench.passes(family(size)) and not bench.passes(family(size + 1))


def test_the_issues_example_is_refused():
    assert not bench.passes(bench.REFUSED)
