"""How many CPUs this process may use: its affinity, and its cgroup's CPU limit (a pod's
``resources.limits.cpu``, a container's ``--cpus``). A pod with a limit of 2 on a 64-core node
sees 64 CPUs in its affinity; 63 OpenMP threads there would be throttled to 2 CPUs' worth of
time and stall each other, so the limit counts."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from epdserve.engine.models.config import load_model_config

log = logging.getLogger("epdserve.frontend")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
CPUS_ENV = "EPDSERVE_CPUS"
# a model whose matrix products hold at least this many weights per token keeps the served
# core busy between the API process's bits of work: it gets every CPU. bench/core_threads.py
# on 2 CPUs (docs/performance.md): at 1.3M (the tiny preset) every CPU but one served 1.6x
# more tokens; at 54M and 387M every CPU served 1.6x more
COMPUTE_BOUND_PARAMS = 10_000_000


def matmul_params(cfg) -> int:
    """Weights a token's forward multiplies by (a ``ModelConfig``): the decoder layers'
    projections and the LM head. A sparse (mixture-of-experts) layer counts what one token
    runs: its router, its top-k experts and the shared expert, not every expert."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    attention = h * (q + 2 * kv) + q * h
    dense = 3 * h * cfg.intermediate_size
    sparse = cfg.num_experts * h + 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    if cfg.shared_expert_intermediate_size:
        sparse += 3 * h * cfg.shared_expert_intermediate_size + h  # and its sigmoid gate
    mlp = sum(sparse if cfg.layer_is_sparse(i) else dense for i in range(cfg.num_layers))
    return cfg.num_layers * attention + mlp + cfg.vocab_size * h


def core_threads(cpus: int, params: int) -> int:
    """OpenMP threads of a served engine core on ``cpus`` CPUs for a model of ``params``
    matmul weights per token: every CPU for a compute-bound model, else every CPU but one,
    which the API process keeps (a parallel region whose thread lost its CPU to the API
    process stalls the step, which costs more than the thread gives on a small model)."""
    return cpus if params >= COMPUTE_BOUND_PARAMS else max(1, cpus - 1)


# The batched-token budget on cpu. A step's matrix products cost 2 x tokens x the layers'
# weights FLOPs; a step's first tokens all come out at its end, so a long step holds back
# every first token it computes (TTFT). The budget is the largest power of two from 2,048
# down to 512 whose step stays within this many FLOPs per core thread (about half a second on
# the CPUs measured). bench/defaults_sweep.py at the 0.5B shape on 2 CPUs
# (docs/performance.md): 512 against 2,048, TTFT p50 4.5 s vs 5.9 s and 402 vs 376 tok/s;
# the tiny and 54M models stay at 2,048, where per-step overhead is the cost.
DEFAULT_BATCHED_TOKENS = 2048
MIN_BATCHED_TOKENS = 512
STEP_FLOPS_PER_THREAD = 2e11


def layer_params(cfg) -> int:
    """Weights every token of a step multiplies by: ``matmul_params`` less the LM head (which
    only the rows that sample run)."""
    return matmul_params(cfg) - cfg.vocab_size * cfg.hidden_size


def batched_tokens(threads: int, params: int) -> int:
    """The cpu default of ``max_num_batched_tokens`` for a core of ``threads`` OpenMP threads
    and a model of ``params`` weights per token (``layer_params``)."""
    budget = DEFAULT_BATCHED_TOKENS
    while budget > MIN_BATCHED_TOKENS and 2 * budget * params > threads * STEP_FLOPS_PER_THREAD:
        budget //= 2
    return budget


def resolve_batched_tokens(config, model_cfg) -> int:
    """``config.max_num_batched_tokens`` when given; else 2,048, or on cpu ``batched_tokens``
    at this process's torch threads (the core's: ``OMP_NUM_THREADS`` when served)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    if config.device != "cpu":
        return DEFAULT_BATCHED_TOKENS
    import torch

    threads, params = torch.get_num_threads(), layer_params(model_cfg)
    budget = batched_tokens(threads, params)
    logging.getLogger("epdserve.core").info(
        "max_num_batched_tokens=%d (the cpu default for %.0fM weights per token at %d "
        "threads; --max-num-batched-tokens sets it)",
        budget,
        params / 1e6,
        threads,
    )
    return budget


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU limit of this process's cgroup in CPUs (``quota / period``), the tightest along
    its path; None when there is none (or no cgroup file can be read). cgroup v2 reads
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``."""
    limits = []
    for version, path in _cgroup_paths(proc_cgroup):
        base = root if version == 2 else root / "cpu"
        for directory in _ancestors(base, path):
            limit = _read_limit(directory, version)
            if limit is not None:
                limits.append(limit)
    return min(limits, default=None)


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """CPUs this process may use: its affinity, within its cgroup's limit rounded down (a
    limit of 2.5 is 2 CPUs for threads that spin; never below 1) and within ``EPDSERVE_CPUS``
    (the operator's word: the pod's limit, else its request, which no cgroup file shows)."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    else:
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    told = os.environ.get(CPUS_ENV, "")
    if told.isdigit() and int(told) > 0:
        cpus = min(cpus, int(told))
    return max(1, cpus)


def core_threads_env(model_dir: str | None = None) -> dict[str, str]:
    """OpenMP threads of the engine core (``engine/cpus.py``): of the CPUs this process may
    use (its affinity within its cgroup's CPU limit), all for a compute-bound model, else all
    but one, which the API process keeps for HTTP, tokenizing and detokenizing.
    ``OMP_NUM_THREADS`` overrides."""
    if os.environ.get("OMP_NUM_THREADS"):
        return {}
    params = 0
    if model_dir is not None:
        try:
            params = matmul_params(load_model_config(model_dir))
        except Exception as exc:  # the core reports a bad model itself: no guess here
            log.debug("no model size for the thread count: %s", exc)
    return {"OMP_NUM_THREADS": str(core_threads(usable_cpus(), params))}


def _cgroup_paths(proc_cgroup: Path) -> list[tuple[int, str]]:
    """``(version, path)`` of the cgroups that can limit CPU: v2's unified one, v1's cpu."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            found.append((2, path))
        elif "cpu" in controllers.split(","):
            found.append((1, path))
    return found


def _ancestors(base: Path, path: str) -> list[Path]:
    """``base/path`` and each directory above it up to ``base`` (inside a container's
    cgroup namespace the path is ``/``: ``base`` itself)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read_limit(directory: Path, version: int) -> float | None:
    try:
        if version == 2:
            quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        value = int(quota) / int(period or "100000")
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return value if value > 0 else None
