"""The CPUs a pod may use: its affinity within its cgroup's CPU limit (v1 and v2 layouts)."""

from __future__ import annotations

import os

import pytest

from epdserve.engine.cpus import cgroup_cpu_limit, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def v2(tmp_path, cpu_max: str | None, path: str = "/", parent: str | None = None):
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{path}\n")
    leaf = tmp_path.joinpath(*[p for p in path.split("/") if p])
    leaf.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (leaf / "cpu.max").write_text(cpu_max + "\n")
    if parent is not None:
        (tmp_path / "cpu.max").write_text(parent + "\n")
    return tmp_path, proc


def v1(tmp_path, quota: str, period: str = "100000", path: str = "/pod"):
    tmp_path.mkdir()
    proc = tmp_path / "cgroup"
    proc.write_text(f"4:memory:{path}\n1:cpu,cpuacct:{path}\n0::/\n")
    leaf = tmp_path / "cpu" / path.strip("/")
    leaf.mkdir(parents=True)
    (leaf / "cpu.cfs_quota_us").write_text(quota + "\n")
    (leaf / "cpu.cfs_period_us").write_text(period + "\n")
    return tmp_path, proc


def test_a_v2_limit_of_one_and_a_half_cpus_is_read_and_rounded_down(tmp_path):
    root, proc = v2(tmp_path, "150000 100000")
    assert cgroup_cpu_limit(root, proc) == 1.5
    assert usable_cpus(root, proc) == 1


def test_no_limit_leaves_the_affinity(tmp_path):
    root, proc = v2(tmp_path, "max 100000")
    assert cgroup_cpu_limit(root, proc) is None
    assert usable_cpus(root, proc) == AFFINITY


def test_the_tightest_limit_along_the_path_counts(tmp_path):
    root, proc = v2(tmp_path, "max 100000", path="/kubepods/pod1/ctr", parent="100000 100000")
    assert cgroup_cpu_limit(root, proc) == 1.0


def test_a_v1_quota_counts_and_minus_one_is_none(tmp_path):
    root, proc = v1(tmp_path / "a", "50000", "100000")
    assert cgroup_cpu_limit(root, proc) == 0.5 and usable_cpus(root, proc) == 1
    root, proc = v1(tmp_path / "b", "-1")
    assert cgroup_cpu_limit(root, proc) is None


@pytest.mark.parametrize("content", ["", "garbage", "0 100000", "100 0"])
def test_unreadable_or_odd_files_are_no_limit(tmp_path, content):
    root, proc = v2(tmp_path, content)
    assert cgroup_cpu_limit(root, proc) is None


def test_a_limit_above_the_affinity_leaves_the_affinity(tmp_path):
    root, proc = v2(tmp_path, f"{(AFFINITY + 8) * 100000} 100000")
    assert usable_cpus(root, proc) == AFFINITY
