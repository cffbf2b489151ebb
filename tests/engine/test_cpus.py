"""The CPUs a pod may use: its affinity within its cgroup's CPU limit (v1 and v2 layouts)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from epdserve.engine.cpus import (
    COMPUTE_BOUND_PARAMS,
    cgroup_cpu_limit,
    core_threads,
    matmul_params,
    usable_cpus,
)

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


def test_compute_bound_models_get_every_cpu_and_small_ones_leave_one_to_the_api():
    assert core_threads(2, COMPUTE_BOUND_PARAMS) == 2
    assert core_threads(2, COMPUTE_BOUND_PARAMS - 1) == 1
    assert core_threads(1, 0) == 1 and core_threads(16, 0) == 15


def test_the_presets_fall_on_the_measured_sides_of_the_bound(models):
    """tiny (overhead-bound: every CPU but one served 1.6x more) below; make-model's
    ``small`` (54M) and the Qwen2.5-0.5B shape (387M; every CPU served 1.6x more) above."""
    from epdserve.engine.make_model import SIZES
    from epdserve.engine.models.config import load_model_config

    tiny_cfg = load_model_config(models.get("llama"))
    assert matmul_params(tiny_cfg) < COMPUTE_BOUND_PARAMS
    hidden, layers, heads, kv, head_dim, inter = SIZES["small"]
    small = replace(
        tiny_cfg, hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=inter, num_layers=layers, vocab_size=4096,
    )  # fmt: skip
    assert matmul_params(small) > COMPUTE_BOUND_PARAMS


def test_a_sparse_layer_counts_the_experts_a_token_runs(models):
    """Top-2 of 8 experts: two experts' weights and the router, not eight; a shared expert
    and its gate on top; dense layers (``sparse_layers``) count their MLP."""
    from epdserve.engine.models.config import load_model_config

    dense = load_model_config(models.get("llama"))
    h, inter = dense.hidden_size, 64
    moe = replace(dense, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=inter)
    per_token = 8 * h + 2 * 3 * h * inter
    dense_mlp = 3 * h * dense.intermediate_size
    assert matmul_params(moe) - matmul_params(dense) == dense.num_layers * (per_token - dense_mlp)
    shared = replace(moe, shared_expert_intermediate_size=96)
    assert matmul_params(shared) - matmul_params(moe) == dense.num_layers * (3 * h * 96 + h)
    one_dense = replace(moe, sparse_layers=(False,) + (True,) * (dense.num_layers - 1))
    assert matmul_params(one_dense) - matmul_params(moe) == dense_mlp - per_token


def test_the_core_env_follows_the_model_unless_omp_num_threads_is_set(models, monkeypatch):
    from epdserve.engine.cpus import core_threads_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = usable_cpus()
    assert core_threads_env(str(models.get("llama"))) == {"OMP_NUM_THREADS": str(max(1, cpus - 1))}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert core_threads_env(str(models.get("llama"))) == {}


def test_the_operators_cpu_count_bounds_the_affinity(tmp_path, monkeypatch):
    root, proc = v2(tmp_path, "max 100000")
    monkeypatch.setenv("EPDSERVE_CPUS", "1")
    assert usable_cpus(root, proc) == 1
    for odd in ("0", "-2", "two", ""):
        monkeypatch.setenv("EPDSERVE_CPUS", odd)
        assert usable_cpus(root, proc) == AFFINITY
