"""Speculative entries: a just-routed prompt counts as cached on its pod for a while."""

from __future__ import annotations

from epdserve.router.pending import PendingPrefixes


def test_a_routed_prompt_matches_on_its_pod_until_it_expires():
    pending = PendingPrefixes(ttl=2.0)
    pending.add("a", [1, 2, 3], now=100.0)
    assert pending.match([1, 2, 9], ["a", "b"], now=101.0) == {"a": 2, "b": 0}
    assert pending.match([1, 2, 3], ["a"], now=102.5) == {"a": 0}


def test_capacity_bounds_the_pending_keys():
    pending = PendingPrefixes(ttl=5.0, capacity=2)
    pending.add("a", [1, 2, 3], now=0.0)
    assert len(pending) == 2
    assert pending.match([1, 2, 3], ["a"], now=1.0) == {"a": 0}  # key 1 was dropped


def test_removing_a_pod_forgets_its_expectations_and_ttl_zero_disables():
    pending = PendingPrefixes(ttl=5.0)
    pending.add("a", [1], now=0.0)
    pending.add("b", [1], now=0.0)
    pending.remove_pod("a")
    assert pending.match([1], ["a", "b"], now=1.0) == {"a": 0, "b": 1}
    off = PendingPrefixes(ttl=0)
    off.add("a", [1])
    assert len(off) == 0
